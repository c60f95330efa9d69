"""``rpcps up``: start a cluster as local processes, report its progress, supervise, stop it cleanly.

Roles run as ``python -m ps`` / ``python -m trainer`` in their own sessions (so a terminal's Ctrl-C
reaches only the launcher, which then stops trainers first and ps0, the store host, last). A trainer
or a server other than ps0 that dies is restarted, at a bounded rate (a server reloads its shard from
the newest checkpoint); ps0, which hosts the rendezvous store, ending ends the run.
"""
from __future__ import annotations

import json
import logging
import math
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
from services.names import format_name

log = logging.getLogger(__name__)

STOP_TIMEOUT = 9.0  # every process gone within 10 s of a stop
STATUS_POLL = 1.0  # seconds between status polls of the trainers
FINAL_CHECKPOINT_TIMEOUT = 30.0
_PS_FLAGS = ("emsize", "nhid", "nlayers", "optimizer", "lr", "seed", "resume_from", "keep_checkpoints",
             "checkpoint_every_steps", "checkpoint_every_seconds")
_TRAINER_FLAGS = ("batch_size", "bptt", "dropout", "clip", "eval_tokens", "synthetic_tokens", "seed", "data",
                  "warmup_steps")
_COMMON_FLAGS = ("threads", "log_level", "checkpoint_dir", "sidecar_host", "rpc_transport")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Member:
    name: str
    module: str
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
    if kind == "progress":
        per = " ".join(f"{n} {s}" for n, s in e["trainers"].items())
        loss = "-" if e["loss"] is None else f"{e['loss']:.3f}"
        evaluating = " | evaluating the held-out split" if e.get("evaluating") else ""
        return (f"step {e['step']}{'/' + str(e['steps']) if e.get('steps') else ''} | loss {loss} | "
                f"{e['tokens_per_s']:.0f} tokens/s | {per}{evaluating}")
    if kind == "restart":
        return f"{e['name']} exited with code {e['exit_code']}; restarting ({e['restarts']} in the window)"
    if kind == "done":
        val = f" | held-out ppl {e['val_ppl']:.1f}" if e.get("val_ppl") is not None else ""
        first = "-" if e["loss_first"] is None else f"{e['loss_first']:.3f}"
        last = "-" if e["loss_last"] is None else f"{e['loss_last']:.3f}"
        return f"done: {e['steps']} steps | loss {first} -> {last} | {e['tokens_per_s']:.0f} tokens/s{val}"
    return " ".join(f"{k}={v}" for k, v in e.items())


class Launcher:
    def __init__(self, cfg: UpConfig, emit: Callable[[dict], None]) -> None:
        self.cfg, self.emit = cfg, emit
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
        ntoken = cfg.ntoken
        if ntoken is None:
            from trainer.data import vocab_size
            ntoken = vocab_size(cfg.data)
        self.master_port = cfg.master_port or free_port()
        names = [format_name("ps", i) for i in range(cfg.ps)] + [format_name("trainer", i) for i in range(cfg.trainers)]
        for i, name in enumerate(names):
            port = cfg.sidecar_port + i if cfg.sidecar_port else free_port()
            is_ps = name.startswith("ps")
            argv = ["--name", name, "--num-ps", str(cfg.ps), "--sidecar-port", str(port),
                    "--master-addr", cfg.master_addr, "--master-port", str(self.master_port)]
            argv += _flags(cfg, _COMMON_FLAGS)
            if is_ps:
                argv += ["--ntoken", str(ntoken), "--resume" if cfg.resume else "--no-resume"] + _flags(cfg, _PS_FLAGS)
            else:
                argv += ["--num-trainers", str(cfg.trainers), "--start"] + _flags(cfg, _TRAINER_FLAGS)
                if cfg.steps:
                    argv += ["--steps", str(cfg.steps)]
            host = "127.0.0.1" if cfg.sidecar_host in ("0.0.0.0", "") else cfg.sidecar_host
            self.members.append(Member(name, "ps" if is_ps else "trainer", argv, f"http://{host}:{port}",
                                       logs / f"{name}.log"))

    def _spawn(self, m: Member) -> None:
        # The token travels in the environment: argv is visible to every user of the machine.
        env = {"RPCPS_CONTROL_TOKEN": self._token} if self._token else None
        m.proc = spawn_role(m.module, m.argv, m.log_path, env)
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
            self._poll_trainers()
            if self.cfg.final_checkpoint and code == 0:
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
                if m.name == "ps0":
                    # ps0 hosts the rendezvous store: every member would have to rejoin.
                    self._fail(f"{m.name} exited with code {code}; see {m.log_path}")
                    return 1
                if not self._restart(m, code):
                    return 1
            if time.monotonic() >= next_poll:  # statuses once a second; liveness every tick
                next_poll = time.monotonic() + STATUS_POLL
                self._poll_trainers()
                if self.cfg.steps and self._all_done():
                    return 0
            if time.monotonic() >= next_report:
                next_report += self.cfg.progress_interval
                self.emit(self._progress())
            self._stop.wait(0.25)
        return 0

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

    def _trainers(self) -> list[Member]:
        return [m for m in self.members if m.module == "trainer"]

    def _poll_trainers(self) -> None:
        for m in self._trainers():
            try:
                with SidecarClient(m.url, timeout=2.0) as c:
                    self._last_status[m.name] = c.status()
            except Exception:
                pass  # restarting or gone: keep the last answer

    def _all_done(self) -> bool:
        for m in self._trainers():
            s = self._last_status.get(m.name) or {}
            ep = s.get("episode") or {}
            if not (ep.get("done") and ep.get("steps") == self.cfg.steps and not s.get("evaluating")):
                return False
        return True

    def _progress(self) -> dict:
        st = [self._last_status.get(m.name, {}) for m in self._trainers()]
        losses = [s["loss_avg"] for s in st if s.get("loss_avg") is not None]
        steps = [((s.get("episode") or {}).get("step") or 0) for s in st]
        return {"event": "progress", "step": min(steps) if steps else 0, "steps": self.cfg.steps,
                "loss": sum(losses) / len(losses) if losses else None,
                "tokens_per_s": sum(s.get("tokens_per_s") or 0.0 for s in st if s.get("state") == "running"),
                "trainers": {m.name: (s.get("episode") or {}).get("step", 0) for m, s in zip(self._trainers(), st)},
                "evaluating": [m.name for m, s in zip(self._trainers(), st) if s.get("evaluating")]}

    def _summary(self) -> dict:
        st = [self._last_status.get(m.name, {}) for m in self._trainers()]
        firsts = [s["loss_first"] for s in st if s.get("loss_first") is not None]
        lasts = [s["loss_avg"] for s in st if s.get("loss_avg") is not None]
        evals = [s["eval"] for s in st if s.get("eval")]
        val_tokens = sum(e["tokens"] for e in evals)
        val_loss = sum(e["loss_sum"] for e in evals) / val_tokens if val_tokens else None
        windows = [s["timed"] for s in st if (s.get("timed") or {}).get("tokens")]
        if windows and len(windows) == len(st):
            # Total tokens over the union of the trainers' timed windows: summing per-trainer rates
            # would count the stretches where one trainer ran alone as if both did.
            span = max(w["end"] for w in windows) - min(w["start"] for w in windows)
            tokens_per_s = sum(w["tokens"] for w in windows) / span if span > 0 else 0.0
        else:
            tokens_per_s = sum(s.get("tokens_per_s") or 0.0 for s in st)
        return {"event": "done",
                "steps": min(((s.get("episode") or {}).get("step") or 0) for s in st) if st else 0,
                "total_steps": sum(s.get("step") or 0 for s in st),
                "loss_first": sum(firsts) / len(firsts) if firsts else None,
                "loss_last": sum(lasts) / len(lasts) if lasts else None,
                "tokens_per_s": tokens_per_s,
                "val_loss": val_loss, "val_ppl": math.exp(val_loss) if val_loss is not None else None,
                "val_tokens": val_tokens,
                "restarts": sum(len(m.restarts) for m in self._trainers())}

    def _final_checkpoint(self) -> None:
        """Before stopping anything, so the trainers' positions are in it too."""
        leader = next(m for m in self.members if m.name == "ps0")
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
        """Trainers first, then the other servers, ps0 (the store host) last."""
        waves = [self._trainers(), [m for m in self.members if m.module == "ps" and m.name != "ps0"],
                 [m for m in self.members if m.name == "ps0"]]
        stop_in_waves([[(m.name, m.proc) for m in w if m.proc is not None] for w in waves], STOP_TIMEOUT)


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


def _flags(cfg: UpConfig, fields: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for f in fields:
        v = getattr(cfg, f)
        if v is not None:
            out += ["--" + f.replace("_", "-"), str(v)]
    return out
