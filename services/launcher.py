"""``rpcps up``: start a cluster as local processes, report its progress, supervise, stop it cleanly.

What to start and how to read its progress is the workload's (``services/workloads.py``). Roles run
as ``python -m services.cli <role>`` in their own sessions (so a terminal's Ctrl-C reaches only the
launcher, which then stops the workers first and the leader, the store host, last). A member other
than the leader that dies is restarted, at a bounded rate (a server reloads its shard from the
newest checkpoint); the leader ending ends the run.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from services.client import SidecarClient
from services.config import UpConfig
from services.workloads import LmWorkload, RlWorkload, flags, make_workload

log = logging.getLogger(__name__)

STOP_TIMEOUT = 9.0  # every process gone within 10 s of a stop
STATUS_POLL = 1.0  # seconds between status polls of the watched roles
FINAL_CHECKPOINT_TIMEOUT = 30.0
_COMMON_FLAGS = ("threads", "log_level", "sidecar_host", "rpc_transport")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Member:
    name: str
    role: str
    argv: list[str]
    url: str
    log_path: Path
    proc: Optional[subprocess.Popen] = None
    restarts: deque = field(default_factory=deque)


def emitter(as_json: bool, out=sys.stdout) -> Callable[[dict], None]:
    def emit(event: dict) -> None:
        out.write((json.dumps(event) if as_json else _human(event)) + "\n")
        out.flush()
    return emit


def _human(e: dict) -> str:
    kind = e["event"]
    if kind == "started":
        return "started " + ", ".join(f"{n} {u}" for n, u in e["sidecars"].items())
    if kind == "restart":
        return f"{e['name']} exited with code {e['exit_code']}; restarting ({e['restarts']} in the window)"
    if kind == "checkpoint":
        return f"checkpoint {e['id']} (step {e['step']}) in {e['path']}"
    if kind == "error":
        return f"error: {e['message']}"
    text = (RlWorkload if "episode" in e or "solved" in e else LmWorkload).human(e)
    return text if text is not None else " ".join(f"{k}={v}" for k, v in e.items())


class Launcher:
    def __init__(self, cfg: UpConfig, emit: Callable[[dict], None]) -> None:
        self.cfg, self.emit = cfg, emit
        self.workload = make_workload(cfg)
        self.checkpoint_dir = cfg.checkpoint_dir or self.workload.checkpoint_dir
        self._stop = threading.Event()
        self.members: list[Member] = []
        self._token = cfg.control_token.get_secret_value() if cfg.control_token else None
        self._last_status: dict[str, dict] = {}

    def request_stop(self) -> None:
        self._stop.set()

    # --- building the cluster ----------------------------------------------------------------------
    def _plan(self) -> None:
        cfg = self.cfg
        logs = cfg.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.master_port = cfg.master_port or free_port()
        for i, planned in enumerate(self.workload.plan()):
            port = cfg.sidecar_port + i if cfg.sidecar_port else free_port()
            argv = [planned.role, "--name", planned.name, "--sidecar-port", str(port),
                    "--master-addr", cfg.master_addr, "--master-port", str(self.master_port),
                    "--checkpoint-dir", str(self.checkpoint_dir), *planned.argv, *flags(cfg, _COMMON_FLAGS)]
            host = "127.0.0.1" if cfg.sidecar_host in ("0.0.0.0", "") else cfg.sidecar_host
            self.members.append(Member(planned.name, planned.role, argv, f"http://{host}:{port}",
                                       logs / f"{planned.name}.log"))

    def _spawn(self, m: Member) -> None:
        # The token travels in the environment: argv is visible to every user of the machine.
        env = {"RPCPS_CONTROL_TOKEN": self._token} if self._token else None
        m.proc = spawn_role("services.cli", m.argv, m.log_path, env)
        log.info("started %s (pid %d), log %s", m.name, m.proc.pid, m.log_path)

    # --- running -------------------------------------------------------------------------------------
    def run(self) -> int:
        self._plan()
        try:
            for m in self.members:
                self._spawn(m)
            self._write_state()
            if not self._wait_ready():
                return 1
            self.emit({"event": "started", "sidecars": {m.name: m.url for m in self.members},
                       "master_port": self.master_port, "logs": str(self.cfg.state_dir / "logs")})
            code = self._supervise()
            self._poll()
            if self.cfg.final_checkpoint and code == 0:
                self._stop_waves(1)          # the workers, which leave their positions with the leader
                self._final_checkpoint()
            self.emit(self._summary())
            return code
        finally:
            self._stop_all()

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.cfg.ready_timeout
        pending = {m.name: m for m in self.members}
        while pending:
            for name, m in list(pending.items()):
                if m.proc.poll() is not None:
                    self._fail(f"{name} exited with code {m.proc.returncode} before it was ready; see {m.log_path}")
                    return False
                with SidecarClient(m.url, timeout=2.0) as c:
                    if c.ready():
                        del pending[name]
            if self._stop.is_set():
                return False
            if time.monotonic() > deadline:
                self._fail(f"not ready within {self.cfg.ready_timeout:.0f}s: {sorted(pending)}")
                return False
            self._stop.wait(0.2)
        return True

    def _supervise(self) -> int:
        next_report = time.monotonic() + self.cfg.progress_interval
        next_poll = 0.0
        while not self._stop.is_set():
            for m in self.members:
                code = m.proc.poll()
                if code is None:
                    continue
                if not self.workload.restartable(m.name):
                    self._fail(f"{m.name} exited with code {code}; see {m.log_path}")
                    return 1
                if not self._restart(m, code):
                    return 1
            if time.monotonic() >= next_poll:  # statuses once a second; liveness every tick
                next_poll = time.monotonic() + STATUS_POLL
                self._poll()
                if self.workload.finished(self._watched_status()):
                    self._report()
                    return 0
            if time.monotonic() >= next_report:
                next_report += self.cfg.progress_interval
                self._report()
            self._stop.wait(0.25)
        return 0

    def _report(self) -> None:
        for event in self.workload.progress(self._watched_status()):
            self.emit(event)

    def _restart(self, m: Member, code: int) -> bool:
        now = time.monotonic()
        while m.restarts and now - m.restarts[0] > self.cfg.restart_window:
            m.restarts.popleft()
        if len(m.restarts) >= self.cfg.max_restarts:
            self._fail(f"{m.name} exited with code {code} and was restarted {len(m.restarts)} times within "
                       f"{self.cfg.restart_window:.0f}s; giving up (see {m.log_path})")
            return False
        m.restarts.append(now)
        self._last_status.pop(m.name, None)
        self.emit({"event": "restart", "name": m.name, "exit_code": code, "restarts": len(m.restarts)})
        self._spawn(m)
        self._write_state()
        return True

    def _watched(self) -> list[Member]:
        names = self.workload.watched([m.name for m in self.members])
        return [m for m in self.members if m.name in names]

    def _poll(self) -> None:
        for m in self._watched():
            try:
                with SidecarClient(m.url, timeout=2.0) as c:
                    self._last_status[m.name] = c.status()
            except Exception:
                pass  # restarting or gone: keep the last answer

    def _watched_status(self) -> dict[str, dict]:
        return {m.name: self._last_status.get(m.name, {}) for m in self._watched()}

    def _summary(self) -> dict:
        return self.workload.summary(self._watched_status(), sum(len(m.restarts) for m in self.members))

    def _final_checkpoint(self) -> None:
        """Once the workers have stopped (their final positions are with the leader), before the
        servers stop: the last state of everything, in one checkpoint."""
        leader = next(m for m in self.members if m.name == self.workload.leader)
        try:
            with SidecarClient(leader.url, token=self._token, timeout=FINAL_CHECKPOINT_TIMEOUT) as c:
                result = c.checkpoint()
            self.emit({"event": "checkpoint", "id": result["id"], "step": result["step"], "path": result["path"]})
        except Exception as exc:  # noqa: BLE001 - stopping must go on; the previous checkpoint stays valid
            self._fail(f"final checkpoint failed: {exc}")

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self.emit({"event": "error", "message": message})

    def _write_state(self) -> None:
        state = {"sidecars": {m.name: m.url for m in self.members},
                 "pids": {m.name: m.proc.pid for m in self.members if m.proc}, "master_port": self.master_port}
        path = self.cfg.state_dir / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path)

    def _stop_all(self) -> None:
        self._stop_waves()

    def _stop_waves(self, count: Optional[int] = None) -> None:
        """The first ``count`` waves (default all): workers first, the leader (the store host) last."""
        by_name = {m.name: m for m in self.members}
        waves = self.workload.stop_waves(list(by_name))[:count]
        stop_in_waves([[(n, by_name[n].proc) for n in wave if by_name[n].proc is not None] for wave in waves],
                      STOP_TIMEOUT)


def spawn_role(module: str, argv: list[str], log_path: Path, env: Optional[dict] = None) -> subprocess.Popen:
    """Start ``python -m module argv`` in its own session, output appended to ``log_path``."""
    with open(log_path, "ab") as logf:
        return subprocess.Popen([sys.executable, "-m", module, *argv], stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})


def stop_in_waves(waves: list[list[tuple[str, subprocess.Popen]]], timeout: float) -> None:
    """SIGTERM each wave and wait for it before the next; SIGKILL whatever outlives the deadline."""
    deadline = time.monotonic() + timeout
    for i, wave in enumerate(waves):
        live = [(n, p) for n, p in wave if p.poll() is None]
        for _, p in live:
            p.send_signal(signal.SIGTERM)
        wave_deadline = min(deadline, time.monotonic() + timeout * (i + 1) / len(waves) + 2)
        for name, p in live:
            try:
                p.wait(max(0.0, wave_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                p.kill()
                p.wait()
    for wave in waves:
        for _, p in wave:
            if p.poll() is None:
                p.kill()
                p.wait()
