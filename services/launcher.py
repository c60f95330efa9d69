"""``rpcps up``: start a cluster as local processes, report its progress, supervise, stop it cleanly.

What to start and how to read its progress is the workload's (its ``Launch``, found through
``services/workload.py``); its settings join the launcher's own in ``UpConfig``. Roles run
as ``python -m services.cli <role>`` in their own sessions (so a terminal's Ctrl-C reaches only the
launcher, which then stops the workers first and the leader, the store host, last). A member that
dies is restarted after a back-off that grows while it keeps dying; the others train on. When the
leader dies, every other member leaves with ``LEADER_LOST`` (``services/leader.py``) and is started
again at once, to join the restarted leader. The run ends when the user stops it, when the workload
says it is finished, or when a member spends ``--max-restarts``.
"""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Optional

from pydantic import Field, SecretStr, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from services.checkpoint.store import CheckpointStore
from services.client import SidecarClient
from services.config import ConfigBase, explain, flag_name, writable_folder
from services.leader import LEADER_LOST
from services.lifecycle import RoleStatus
from services.names import parse_name
from services.workload import Launch, roles, workloads

log = logging.getLogger(__name__)

STOP_TIMEOUT = 9.0  # every process gone within 10 s of a stop
STATUS_POLL = 1.0  # seconds between status polls of the watched roles
FINAL_CHECKPOINT_TIMEOUT = 30.0
_COMMON_FLAGS = ("threads", "log_level", "sidecar_host", "rpc_transport")


class LauncherConfig(ConfigBase):
    """``rpcps up``: the launcher's own settings, whatever the workload."""

    workload: str = Field(description="which workload to run")
    as_json: bool = Field(False, description="print JSON lines instead of human progress",
                          json_schema_extra={"flag": "--json", "env": "RPCPS_JSON"})
    threads: int = Field(1, ge=1, description="torch threads per process")
    rpc_transport: Literal["uv", "shm"] = Field("uv", description="TensorPipe transport of every role")
    master_addr: str = Field("127.0.0.1", description="address of the rendezvous store (the leader: ps0 or the agent)")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port (0: a free port)")
    sidecar_host: str = Field("127.0.0.1", description="address the sidecars bind")
    sidecar_port: int = Field(0, ge=0, le=65535, description="first sidecar port, one per role in order (0: free ports)")
    progress_interval: float = Field(5.0, gt=0, description="seconds between progress lines")
    restart_backoff: float = Field(1.0, gt=0, description="seconds before a dead member is restarted; doubled "
                                                          "for each death in a row, up to --restart-backoff-max")
    restart_backoff_max: float = Field(60.0, gt=0, description="the longest wait before a restart")
    restart_window: float = Field(60.0, gt=0, description="a member up this long is healthy again: its next "
                                                          "death waits --restart-backoff")
    max_restarts: Optional[int] = Field(None, ge=0, description="end the run after this many deaths in a row of "
                                                                "one member (default: never; it is shown failing)")
    ready_timeout: float = Field(180.0, gt=0, description="seconds for every role to become ready")
    state_dir: Path = Field(Path(".rpcps"), description="where role logs and cluster.json go")
    resume: bool = Field(True, description="resume from the newest valid checkpoint (--no-resume: start fresh)")
    resume_from: Optional[str] = Field(None, description="resume from this checkpoint (step-N or its path)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept")
    final_checkpoint: bool = Field(True, description="take a checkpoint when stopping")
    checkpoint_dir: Optional[Path] = Field(None, description="folder of the checkpoints (default: the workload's own)")
    control_token: Optional[SecretStr] = Field(None, description="bearer token for the sidecars' POST routes")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level of every role")

    # Set on the composed ``UpConfig``: each workload's own settings, by name.
    workload_settings: ClassVar[dict[str, type[ConfigBase]]] = {}

    _folders = field_validator("checkpoint_dir", "state_dir")(
        classmethod(lambda cls, v: v if v is None else writable_folder(v)))

    @model_validator(mode="after")
    def _check(self) -> "LauncherConfig":
        settings = type(self).workload_settings
        if self.workload not in settings:
            raise ValueError(f"--workload: unknown workload {self.workload!r}; one of {', '.join(settings)}")
        # A setting of another workload would be silently ignored: refuse it instead.
        mine = set(settings[self.workload].model_fields) | set(LauncherConfig.model_fields)
        wrong = sorted(self.model_fields_set - mine)
        if wrong:
            names = ", ".join(flag_name(f, type(self).model_fields[f]) for f in wrong)
            raise ValueError(f"{names}: not a setting of --workload {self.workload}")
        # The workload's own checks (its validators) run here, so a bad value is a ConfigError
        # at load naming its flag, not a failure once the launch has begun.
        try:
            self.settings()
        except ValidationError as exc:
            fields = type(self).model_fields
            problems = []
            for e in exc.errors():
                field = str(e["loc"][0]) if e["loc"] else None
                problems.append(explain(e["msg"], field and flag_name(field, fields.get(field)), e["input"] if field else None))
            raise ValueError("; ".join(problems)) from None
        return self

    def settings(self) -> ConfigBase:
        """The chosen workload's settings: those given, its defaults for the rest."""
        model = type(self).workload_settings[self.workload]
        return model.model_validate({f: getattr(self, f) for f in self.model_fields_set if f in model.model_fields})

    def restoring_flags(self) -> list[str]:
        """How the leader (and the servers) should restore and keep checkpoints."""
        out = ["--resume" if self.resume else "--no-resume", "--keep-checkpoints", str(self.keep_checkpoints)]
        return out + (["--resume-from", self.resume_from] if self.resume_from else [])


def compose_up_config() -> type[LauncherConfig]:
    """``LauncherConfig`` with every registered workload's settings as fields (one flag each, as
    `rpcps up --help` lists them): a field two workloads share takes each one's default from it."""
    settings = {name: spec.up for name, spec in workloads().items()}
    declared: dict[str, list[tuple[str, FieldInfo]]] = {}
    for name, model in settings.items():
        for setting, info in model.model_fields.items():
            declared.setdefault(setting, []).append((name, info))
    fields: dict[str, Any] = {}
    for setting, where in declared.items():
        first = where[0][1]
        if len(where) == 1:
            about = f"{where[0][0]}: {first.description}"
        else:
            about = "; ".join(f"{name}: {info.description} (default {info.default})" for name, info in where)
        fields[setting] = (Optional[first.annotation], FieldInfo.merge_field_infos(first, default=None, description=about))
    specs = workloads()
    about = "which workload to run: " + ", ".join(f"{name} ({spec.help})" for name, spec in specs.items())
    fields["workload"] = (Literal[tuple(specs)], Field(next(iter(specs)), description=about))
    composed = create_model("UpConfig", __base__=LauncherConfig, **fields)
    composed.workload_settings = settings
    return composed


UpConfig = compose_up_config()


_FIRST_PORT = 20000    # above the well-known and most registered services' ports
_handed_out: set[int] = set()          # by free_port, in this process: never twice
_handed_out_lock = threading.Lock()


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive ports free on loopback (a role listens at a base port
    plus its index, as torchrun's workers' sidecars do). Taken below the kernel's ephemeral
    range: there no outgoing connection can take one before its listener binds it."""
    top = _ephemeral_low()
    if top - count <= _FIRST_PORT:    # no room below it: anywhere, as a last resort
        top = 65536
    with _handed_out_lock:
        for _ in range(200):
            ports = range(base := random.randrange(_FIRST_PORT, top - count), base + count)
            if _handed_out.isdisjoint(ports) and all(map(_bindable, ports)):
                _handed_out.update(ports)
                return base
    raise RuntimeError(f"no {count} consecutive free ports in {_FIRST_PORT}-{top - 1}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768        # Linux's default; elsewhere a guess that is still a free port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Member:
    name: str
    role: str
    argv: list[str]
    url: str
    log_path: Path
    proc: Optional[subprocess.Popen] = None
    started_at: float = 0.0                 # time.monotonic() of its last start
    deaths: int = 0                         # in a row: each before it stayed up --restart-window
    restarts: int = 0                       # in this run
    last_exit: Optional[int] = None
    restart_at: Optional[float] = None      # time.monotonic() its restart is due, while it waits

    def failing(self) -> Optional[dict]:
        """What ``rpcps status`` shows of a member in a crash loop (None: not failing)."""
        if not self.deaths:
            return None
        due = None if self.restart_at is None else time.time() + max(0.0, self.restart_at - time.monotonic())
        return {"exit_code": self.last_exit, "deaths": self.deaths, "restart_at": due}


def emitter(as_json: bool, workload: Optional[Launch] = None, out=sys.stdout) -> Callable[[dict], None]:
    def emit(event: dict) -> None:
        out.write((json.dumps(event) if as_json else _human(event, workload)) + "\n")
        out.flush()
    return emit


def _human(e: dict, workload: Optional[Launch]) -> str:
    kind = e["event"]
    if kind == "started":
        return "started " + ", ".join(f"{n} {u}" for n, u in e["sidecars"].items())
    if kind == "restart" and e["exit_code"] == LEADER_LOST:
        return f"{e['name']} lost its leader; restarting it to rejoin"
    if kind == "restart":
        return (f"{e['name']} exited with code {e['exit_code']}; restarting in {e['in']:.0f}s "
                f"({e['restarts']} in a row)")
    if kind == "checkpoint":
        return f"checkpoint {e['id']} (step {e['step']}) in {e['path']}"
    if kind == "error":
        return f"error: {e['message']}"
    text = workload.human(e) if workload is not None else None
    return text if text is not None else " ".join(f"{k}={v}" for k, v in e.items())


class Launcher:
    def __init__(self, cfg: LauncherConfig, emit: Optional[Callable[[dict], None]] = None) -> None:
        spec = workloads()[cfg.workload]
        self.cfg = cfg
        self.workload: Launch = spec.launcher(cfg, cfg.settings())
        self.leader = spec.leader
        self.emit = emit or emitter(cfg.as_json, self.workload)
        self.checkpoint_dir = cfg.checkpoint_dir or Path(spec.checkpoint_dir)
        self._stop = threading.Event()
        self.members: list[Member] = []
        self._token = cfg.control_token.get_secret_value() if cfg.control_token else None
        self._last_status: dict[str, dict] = {}
        self._newest_at_start: Optional[str] = None   # the newest checkpoint before this run

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

    def _newest_checkpoint(self) -> Optional[str]:
        found = CheckpointStore(self.checkpoint_dir).list()
        return found[0].id if found else None

    def _spawn(self, m: Member) -> None:
        # The token travels in the environment: argv is visible to every user of the machine.
        env = {"RPCPS_RESTARTS_IN_A_ROW": str(m.deaths), **({"RPCPS_CONTROL_TOKEN": self._token} if self._token else {})}
        argv = m.argv
        if m.name == self.leader and m.restarts and self._newest_checkpoint() != self._newest_at_start:
            # This run has committed a checkpoint: a restarted leader resumes it, whatever the
            # first start was told (--no-resume, --resume-from an older one).
            argv = resuming_newest(argv)
        m.proc = spawn_role("services.cli", argv, m.log_path, env)
        m.started_at = time.monotonic()
        log.info("started %s (pid %d), log %s", m.name, m.proc.pid, m.log_path)

    # --- running -------------------------------------------------------------------------------------
    def run(self) -> int:
        self._plan()
        self._newest_at_start = self._newest_checkpoint()
        try:
            for m in self.members:
                self._spawn(m)
            self._write_state()
            refused = self._wait_ready()
            if refused is not None:
                return refused
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

    def _wait_ready(self) -> Optional[int]:
        """None once every role is ready; else the exit code ``up`` ends with (2: a role refused
        its settings, as ``up`` itself would)."""
        deadline = time.monotonic() + self.cfg.ready_timeout
        pending = {m.name: m for m in self.members}
        while pending:
            for name, m in list(pending.items()):
                if m.proc.poll() is not None:
                    said = refusal(m.log_path) if m.proc.returncode == 2 else None
                    self._fail(f"{name} refused to start: {said}" if said else
                               f"{name} exited with code {m.proc.returncode} before it was ready; see {m.log_path}")
                    return 2 if said else 1
                with SidecarClient(m.url, timeout=2.0) as c:
                    if c.ready():
                        del pending[name]
            if self._stop.is_set():
                return 1
            if time.monotonic() > deadline:
                self._fail(f"not ready within {self.cfg.ready_timeout:.0f}s: {sorted(pending)}")
                return 1
            self._stop.wait(0.2)
        return None

    def _supervise(self) -> int:
        next_report = time.monotonic() + self.cfg.progress_interval
        next_poll = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            for m in self.members:
                if m.restart_at is not None:
                    if now >= m.restart_at:
                        self._respawn(m)
                    continue
                code = m.proc.poll()
                if code is None:
                    if m.deaths and now - m.started_at >= self.cfg.restart_window:
                        m.deaths = 0          # up long enough: healthy again
                        self._write_state()
                    continue
                if code == LEADER_LOST:
                    self._rejoin(m)
                elif not self._schedule_restart(m, code):
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

    def _schedule_restart(self, m: Member, code: int) -> bool:
        """A member died: restart it after a back-off that doubles with each death in a row (as
        Kubernetes does), while the others go on. False: the user set --max-restarts and it is spent."""
        if self.cfg.max_restarts is not None and m.deaths >= self.cfg.max_restarts:
            self._fail(f"{m.name} exited with code {code} after {m.deaths} restarts in a row; giving up "
                       f"(--max-restarts; see {m.log_path})")
            return False
        m.deaths += 1
        m.restarts += 1
        m.last_exit = code
        delay = min(self.cfg.restart_backoff_max, self.cfg.restart_backoff * 2 ** (m.deaths - 1))
        m.restart_at = time.monotonic() + delay
        self._last_status.pop(m.name, None)
        self.emit({"event": "restart", "name": m.name, "exit_code": code, "restarts": m.deaths, "in": delay})
        self._write_state()
        return True

    def _rejoin(self, m: Member) -> None:
        """``m`` left because the leader died: start it now (it waits for the new leader); no
        death of its own, so no back-off."""
        m.restarts += 1
        m.last_exit = LEADER_LOST
        self._last_status.pop(m.name, None)
        self.emit({"event": "restart", "name": m.name, "exit_code": LEADER_LOST, "restarts": m.deaths, "in": 0.0})
        self._respawn(m)

    def _respawn(self, m: Member) -> None:
        m.restart_at = None
        self._spawn(m)
        self._write_state()

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

    def _watched_status(self) -> dict[str, RoleStatus]:
        return {m.name: roles()[parse_name(m.name).role].status.model_validate(self._last_status.get(m.name, {}))
                for m in self._watched()}

    def _summary(self) -> dict:
        return self.workload.summary(self._watched_status(), sum(m.restarts for m in self.members))

    def _final_checkpoint(self) -> None:
        """Once the workers have stopped (their final positions are with the leader), before the
        servers stop: the last state of everything, in one checkpoint."""
        leader = next(m for m in self.members if m.name == self.leader)
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
        state = {"sidecars": {m.name: m.url for m in self.members}, "leader": self.leader,
                 "checkpoint_dir": str(self.checkpoint_dir.resolve()),
                 "pids": {m.name: m.proc.pid for m in self.members if m.proc}, "master_port": self.master_port,
                 "failing": {m.name: f for m in self.members if (f := m.failing()) is not None}}
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


def flags(settings: ConfigBase, fields: tuple[str, ...]) -> list[str]:
    """The role flags that pass on ``settings``' values of ``fields`` (those that are set)."""
    out: list[str] = []
    for f in fields:
        v: Any = getattr(settings, f)
        if v is not None:
            out += [flag_name(f), str(v)]
    return out


def resuming_newest(argv: list[str]) -> list[str]:
    """``argv`` with its restore flags replaced by ``--resume`` (the newest valid checkpoint)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume-from":
            skip = True
        elif arg not in ("--resume", "--no-resume"):
            out.append(arg)
    return out + ["--resume"]


def refusal(log_path: Path) -> Optional[str]:
    """What a role said when it refused to start (``rpcps <role>: …``, its last such line), if it did."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-50:]
    except OSError:
        return None
    said = [line for line in lines if line.startswith("rpcps ") and ": " in line]
    return said[-1].split(": ", 1)[1] if said else None
