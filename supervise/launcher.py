"""``rpcps up``: start a cluster as local processes, report its progress, supervise, stop it cleanly.

What to start and how to read its progress is the workload's (its ``Launch``, found through
``services/workload.py``); its settings join the launcher's own in ``UpConfig``. Roles run
as ``python -m supervise.cli <role>`` in their own sessions (so a terminal's Ctrl-C reaches only the
launcher, which then stops the workers first and the leader, the store host, last). A member that
dies is restarted after a back-off that grows while it keeps dying; the others train on. When the
leader dies, every other member leaves with ``LEADER_LOST`` (``services/leader.py``) and is started
again at once, to join the restarted leader. The run ends when the user stops it, when the workload
says it is finished, or when a member spends ``--max-restarts``. The processes themselves (planned,
started, restarted, recorded, stopped) are its ``Roster`` (``supervise/roster.py``).
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from services.client import SidecarClient
from services.config import writable_folder
from services.errors import ConfigError
from supervise.hosts.network import Unavailable
from services.leader import LEADER_LOST
from services.lease import FENCED
from services.lifecycle import RoleStatus
from supervise.liveness import Liveness
from services.names import parse_name
from supervise.member import Member, cause
from supervise.roster import LeaderWants, Roster, final_checkpoint
from supervise.upconfig import LauncherConfig
from services.workload import Launch, roles, workloads

log = logging.getLogger(__name__)

STATUS_POLL = 1.0  # seconds between status polls of the watched roles


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
        return f"{e['name']} left to rejoin the group (its leader was lost, or evicted it); restarting it"
    if kind == "lost":
        return f"{e['name']} lost: {e['reason']}; stopping it, and a replacement starts"
    if kind == "relocated":
        return f"{e['name']} cannot start where it ran ({e['reason']}); it starts at {e['to']}"
    if kind == "restart":
        return (f"{e['name']} exited with code {e['exit_code']} ({e['reason']}); restarting in {e['in']:.0f}s "
                f"({e['restarts']} in a row)")
    if kind == "waiting":
        return f"waiting for {', '.join(e['waiting'])} ({e['ready']}/{e['members']} ready)"
    if kind == "scale" and e["action"] == "started":
        return f"{e['name']} started for a change of layout ({e['sidecar']})"
    if kind == "scale":
        return f"{e['name']} stopped, not started again: {e['reason']}"
    if kind == "move":
        return (f"layout {e['epoch']}: moving {e.get('moved_slots', 0)} slots from {', '.join(e['from'])} onto "
                f"{', '.join(e['to'])}")
    if kind == "moved" and e["state"] == "done":
        return (f"layout {e['epoch']} in force: trainers held {e.get('pause_seconds', 0):.2f}s, "
                f"{(e.get('ahead_bytes', 0) + e.get('bytes', 0)) / 1e6:.1f} MB moved in {e.get('seconds', 0):.1f}s"
                + (f"; not rebuilt: {', '.join(e['not_rebuilt'])}" if e.get("not_rebuilt") else ""))
    if kind == "moved":
        return f"the change to layout {e['epoch']} failed, the layout before stays in force: {e.get('error')}"
    if kind == "checkpoint":
        return f"checkpoint {e['id']} (step {e['step']}) in {e['path']}"
    if kind == "resuming":
        how = "" if e["given"] else (f", the newest in {e['checkpoint_dir']} (start fresh with --no-resume, or "
                                     f"another --checkpoint-dir)")
        return f"resuming from checkpoint {e['checkpoint']}{how}"
    if kind in ("error", "warning"):
        return f"{kind}: {e['message']}"
    text = workload.human(e) if workload is not None else None
    if text is not None and kind == "done" and e.get("ended", "finished") != "finished" and text.startswith("done"):
        text = e["ended"] + text[len("done"):]        # the same summary, of a run that did not finish
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
        self.roster = Roster(cfg, self.workload, self.leader, self.checkpoint_dir, self.emit, self._fail)
        self.roster.on_restart = lambda m: self._last_status.pop(m.name, None)
        self.roster.on_respawn = lambda m: self.liveness.watch(m.name, m.url)    # at its address now
        self.members = self.roster.members
        self._last_status: dict[str, dict] = {}
        self._started_at = time.monotonic()           # when every member was ready
        self._finished = False                        # the workload said its work is done
        self.liveness = Liveness(cfg.member_timeout, cfg.ready_timeout)
        self.wants = LeaderWants(self.workload, self.leader, self.roster, self.liveness, self.emit)

    def request_stop(self) -> None:
        self._stop.set()

    # --- building the cluster ----------------------------------------------------------------------
    # --- running -------------------------------------------------------------------------------------
    def run(self) -> int:
        # A workload with work to do before anything starts (try its model and data, settle what
        # every member must share) says so with ``prepare()``, which returns warnings or raises a
        # ConfigError (``rpcps up`` exits 2 with its sentence).
        prepare = getattr(self.workload, "prepare", None)
        for warning in prepare() if prepare is not None else ():
            self.emit({"event": "warning", "message": warning})
        if self.cfg.local:
            # A workload that can train in one process says so with ``run_local(emit, should_stop)``.
            local = getattr(self.workload, "run_local", None)
            if local is None:
                self._fail(f"--local: the {self.cfg.workload} workload has no one-process mode")
                return 2
            try:
                return local(self.emit, self._stop.is_set)
            except ConfigError as exc:
                self._fail(str(exc))
                return 2
        try:
            writable_folder(self.checkpoint_dir)
        except ValueError as exc:    # refused before anything starts, as a role would refuse it
            self._fail(f"--checkpoint-dir: {exc}")
            return 2
        roster = self.roster
        roster.newest_at_start = roster.newest_checkpoint()
        resuming = self.cfg.resume_from or (roster.newest_at_start if self.cfg.resume else None)
        if resuming:
            self.emit({"event": "resuming", "checkpoint": resuming, "checkpoint_dir": str(self.checkpoint_dir),
                       "given": bool(self.cfg.resume_from)})
        try:
            try:
                roster.plan()
            except Unavailable as exc:       # hosts that cannot be made, no Slurm allocation
                self._fail(f"{self.cfg.run_on_flag}: {exc}")
                return 2
            for m in self.members:
                roster.spawn(m)
                # Asked from its start: a member cut off right after it was ready is then judged
                # by --member-timeout, not --ready-timeout.
                self.liveness.watch(m.name, m.url)
            roster.write_state()
            refused = self._wait_ready()
            if refused is not None:
                return refused
            self._started_at = time.monotonic()
            self.emit({"event": "started", "sidecars": {m.name: m.url for m in self.members},
                       "master_port": roster.master_port, "logs": str(self.cfg.state_dir / "logs")})
            code = self._supervise()
            self._poll()
            if self.cfg.final_checkpoint and code == 0:
                roster.stop_waves(1)          # the workers, which leave their positions with the leader
                final_checkpoint(roster)
            self.emit({**self._summary(), "ended": "finished" if self._finished else "failed" if code else "stopped"})
            return code
        finally:
            self.liveness.close()
            roster.close()

    def _wait_ready(self) -> Optional[int]:
        """None once every role is ready; else the exit code ``up`` ends with (2: a role refused
        its settings, as ``up`` itself would). Says who it waits for whenever that changes, and
        every --progress-interval while it does not: a start on a busy machine can take minutes."""
        deadline = time.monotonic() + self.cfg.ready_timeout
        pending = {m.name: m for m in self.members}
        said: tuple[Optional[list[str]], float] = (None, 0.0)
        while pending:
            for name, m in list(pending.items()):
                if m.proc.poll() is not None:
                    return self._died_starting(m)
                with SidecarClient(m.url, timeout=2.0) as c:
                    if c.ready():
                        del pending[name]
            waiting = [m.name for m in self.members if m.name in pending]
            if pending and (waiting != said[0] or time.monotonic() - said[1] >= self.cfg.progress_interval):
                self.emit({"event": "waiting", "waiting": waiting, "ready": len(self.members) - len(waiting),
                           "members": len(self.members)})
                said = (waiting, time.monotonic())
            if self._stop.is_set():
                return 1
            if time.monotonic() > deadline:
                self._fail(f"not ready within {self.cfg.ready_timeout:.0f}s: {', '.join(waiting)} "
                           f"(their logs are in {self.cfg.state_dir / 'logs'})")
                return 1
            self._stop.wait(0.2)
        return None

    def _died_starting(self, m: Member) -> int:
        """``m`` exited before it was ready: say why, in its own words, and end the run."""
        code = m.proc.returncode
        said = refusal(m.log_path) if code == 2 else None
        if said:
            self._fail(f"{m.name} refused to start: {said}")
            return 2
        self._fail(f"{m.name} exited with code {code} before it was ready: {cause(m.log_path)} (log: {m.log_path})")
        return 1

    def _supervise(self) -> int:
        next_report = time.monotonic() + self.cfg.progress_interval
        next_poll = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            for m in list(self.members):       # a member let go leaves the list
                if m.restart_at is not None:
                    if now >= m.restart_at:
                        self.roster.respawn(m)
                    continue
                code = m.proc.poll()
                if code is None:
                    if self.roster.restarts.healthy_again(m, now):
                        m.healthy()           # up long enough: its deaths are no longer in a row
                        self.roster.write_state()
                    if not m.answering and self.liveness.heard_since(m.name, m.started_at):
                        m.answering = True            # from now on, judged by --member-timeout
                        self.roster.write_state()
                    silent = self.liveness.overdue(m.name, m.started_at, now)
                    if silent is not None and m.fenced is None:
                        self.roster.fence(m, f"no answer from its sidecar for {silent:.0f}s "
                                       f"(--member-timeout {self.cfg.member_timeout:g})")
                    continue
                if code == FENCED and m.fenced is None:
                    # It fenced itself a moment before its silence was judged here: lost all the same.
                    self.roster.fence(m, cause(m.log_path, m.log_start))
                if code == LEADER_LOST:
                    self.roster.rejoin(m)
                elif self.wants.unwanted(m, code):
                    continue                  # let go: the leader's layout holds nothing of it
                elif not self.roster.schedule_restart(m, code):
                    return 1
            if time.monotonic() >= next_poll:  # statuses once a second; liveness every tick
                next_poll = time.monotonic() + STATUS_POLL
                self._poll()
                if self.workload.finished(self._watched_status()):
                    self._report()
                    self._finished = True
                    return 0
            if time.monotonic() >= next_report:
                next_report += self.cfg.progress_interval
                self._report()
            self._stop.wait(0.25)
        return 0

    def _report(self) -> None:
        for event in self.workload.progress(self._watched_status()):
            self.emit({**event, "elapsed_s": round(time.monotonic() - self._started_at, 1)})

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
        self.wants.update()

    def _watched_status(self) -> dict[str, RoleStatus]:
        return {m.name: roles()[parse_name(m.name).role].status.model_validate(self._last_status.get(m.name, {}))
                for m in self._watched()}

    def _summary(self) -> dict:
        return self.workload.summary(self._watched_status(), sum(m.restarts for m in self.members))

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self.emit({"event": "error", "message": message})

def refusal(log_path: Path) -> Optional[str]:
    """What a role said when it refused to start (``rpcps <role>: …``, its last such line), if it did."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-50:]
    except OSError:
        return None
    said = [line for line in lines if line.startswith("rpcps ") and ": " in line]
    return said[-1].split(": ", 1)[1] if said else None
