"""The members ``rpcps up`` runs, as processes: where each is planned (its argv, sidecar, log),
started, started again when it dies (when the policy of ``restarts.py`` says; at once when it only
lost its leader), stopped where it runs when it is judged lost, recorded in ``cluster.json`` for
``rpcps status``/``chaos``/``down``, and stopped in waves."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

from services.checkpoint.store import CheckpointStore
from services.client import SidecarClient, SidecarError
from services.leader import LEADER_LOST
from supervise.member import Member
from supervise.placement import placement_for
from supervise.processes import free_port, stop_in_waves
from supervise.restarts import RestartPolicy
from supervise.upconfig import LauncherConfig, flags
from services.workload import Launch, Planned

log = logging.getLogger("supervise.launcher")

STOP_TIMEOUT = 9.0  # every process gone within 10 s of a stop
FINAL_CHECKPOINT_TIMEOUT = 30.0
_COMMON_FLAGS = ("threads", "log_level", "http_read_timeout", "rpc_transport", "rpc_channel")


class Roster:
    def __init__(self, cfg: LauncherConfig, workload: Launch, leader: str, checkpoint_dir: Path,
                 emit: Callable[[dict], None], fail: Callable[[str], None],
                 restarts: Optional[RestartPolicy] = None) -> None:
        """``restarts``: when a member that died starts again (default: as ``cfg`` says)."""
        self.cfg, self.workload, self.leader, self.checkpoint_dir = cfg, workload, leader, checkpoint_dir
        self.emit, self.fail = emit, fail
        self.restarts = restarts or RestartPolicy.of(cfg)
        self.members: list[Member] = []
        self.master_port = 0
        self.token = cfg.control_token.get_secret_value() if cfg.control_token else None
        self.newest_at_start: Optional[str] = None   # the newest checkpoint before this run
        self.on_restart: Callable[[Member], None] = lambda m: None   # its last status is stale
        self.on_respawn: Callable[[Member], None] = lambda m: None   # started again, maybe elsewhere
        self.placement = placement_for(cfg)
        self._own_argv: dict[str, list[str]] = {}    # each member's role flags, as the workload planned them

    def plan(self) -> None:
        cfg = self.cfg
        logs = cfg.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.master_port = cfg.master_port or free_port()
        planned = self.workload.plan()
        self.placement.create([p.name for p in planned])
        for p in planned:
            self._own_argv[p.name] = p.argv
            m = Member(p.name, p.role, [], "", logs / f"{p.name}.log")
            self._place(m, anew=True)
            self.members.append(m)

    def add(self, planned: Planned) -> Member:
        """A member planned while the run goes on (a server a change of layout asks for): placed
        where its placement puts a new one, and started."""
        self.placement.add(planned.name)
        self._own_argv[planned.name] = planned.argv
        m = Member(planned.name, planned.role, [], "", self.cfg.state_dir / "logs" / f"{planned.name}.log")
        self._place(m, anew=True)
        self.members.append(m)
        self.spawn(m)
        self.write_state()
        return m

    def replan(self, planned: Planned) -> None:
        """A member's own flags as the workload plans them now (its next start takes them)."""
        m = next(m for m in self.members if m.name == planned.name)
        self._own_argv[m.name] = planned.argv
        self._place(m, anew=False)

    def remove(self, m: Member) -> None:
        """A member that stopped for good (exit 0, wanted no more): not started again, and its
        place given back to its placement."""
        self.members.remove(m)
        self.placement.remove(m.name)
        self.write_state()

    def _place(self, m: Member, anew: bool) -> None:
        """``m``'s command line and sidecar address, where its placement puts it now; a member
        that did not move keeps its port."""
        place = self.placement
        port = place.sidecar_port(m.name) if anew else int(m.url.rsplit(":", 1)[1])
        m.argv = [m.role, "--name", m.name, "--sidecar-port", str(port), "--sidecar-host", place.sidecar_host(m.name),
                  "--master-addr", place.master_addr(self.leader), "--master-port", str(self.master_port),
                  "--checkpoint-dir", str(self.checkpoint_dir),
                  # A peer silent for the member timeout is lost: no RPC waits on it longer.
                  "--rpc-timeout", f"{self.cfg.member_timeout:g}",
                  *self._own_argv[m.name], *flags(self.cfg, _COMMON_FLAGS)]
        m.url = f"http://{place.reach(m.name)}:{port}"

    def newest_checkpoint(self) -> Optional[str]:
        found = CheckpointStore(self.checkpoint_dir).list()
        return found[0].id if found else None

    def spawn(self, m: Member) -> None:
        # The token travels in the environment: argv is visible to every user of the machine.
        env = {"RPCPS_RESTARTS_IN_A_ROW": str(m.deaths), "RPCPS_LEASE_TIMEOUT": f"{self.cfg.member_timeout:g}",
               **({"RPCPS_CONTROL_TOKEN": self.token} if self.token else {})}
        argv = m.argv
        if m.name == self.leader and m.restarts and self.newest_checkpoint() != self.newest_at_start:
            # This run has committed a checkpoint: a restarted leader resumes it, whatever the
            # first start was told (--no-resume, --resume-from an older one).
            argv = resuming_newest(argv)
        m.log_start = m.log_path.stat().st_size if m.log_path.exists() else 0
        m.answering = False
        m.proc = self.placement.spawn(m.name, argv, m.log_path, env)
        m.started_at = time.monotonic()
        log.info("started %s (pid %d), log %s", m.name, m.proc.pid, m.log_path)

    def schedule_restart(self, m: Member, code: int) -> bool:
        """A member died: start it again when the policy says (``restarts.py``), while the others
        go on. False: the policy ends the run (said through ``fail``)."""
        verdict = self.restarts.after_death(m, code)
        if verdict.delay is None:
            self.fail(verdict.ends_run)
            return False
        m.causes = (*m.causes, verdict.reason)
        m.deaths += 1
        m.restarts += 1
        m.last_exit = code
        m.restart_at = time.monotonic() + verdict.delay
        self.on_restart(m)
        self.emit({"event": "restart", "name": m.name, "exit_code": code, "reason": verdict.reason,
                   "restarts": m.deaths, "in": verdict.delay})
        self.write_state()
        return True

    def rejoin(self, m: Member) -> None:
        """``m`` left because the leader died: start it now (it waits for the new leader); no
        death of its own, so no back-off."""
        m.restarts += 1
        m.last_exit = LEADER_LOST
        self.on_restart(m)
        self.emit({"event": "restart", "name": m.name, "exit_code": LEADER_LOST,
                   "reason": "it left to rejoin the group (its leader was lost, or evicted it)",
                   "restarts": m.deaths, "in": 0.0})
        self.respawn(m)

    def fence(self, m: Member, why: str) -> None:
        """``m`` is declared lost though its process lives (``supervise/liveness.py``): say so, and
        stop it where it runs (a stopped process is killed all the same; a Slurm step is
        cancelled), so that the restart path replaces it and no second copy serves."""
        m.fenced = why
        log.warning("%s lost: %s; stopping it %s", m.name, why, m.proc.where())
        self.emit({"event": "lost", "name": m.name, "reason": why, "where": m.proc.where()})
        m.proc.kill()
        self._renew(m)

    def _renew(self, m: Member) -> bool:
        """``m``'s next start placed afresh, if its placement can: the others find it there (a new
        leader's address is everyone's next start's, after they leave the old leader's group)."""
        if not self.placement.renew(m.name):
            return False
        for member in self.members:
            self._place(member, anew=member is m)
        return True

    def respawn(self, m: Member) -> None:
        m.restart_at = None
        m.fenced = None
        gone = self.placement.gone(m.name)
        if gone and self._renew(m):
            self.emit({"event": "relocated", "name": m.name, "reason": gone, "to": m.url})
        self.spawn(m)
        self.on_respawn(m)
        self.write_state()

    def write_state(self) -> None:
        path = self.cfg.state_dir / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cluster_record(self), indent=1))
        tmp.replace(path)

    def stop_waves(self, count: Optional[int] = None) -> None:
        """The first ``count`` waves (default all): workers first, the leader (the store host) last."""
        by_name = {m.name: m for m in self.members}
        if not by_name:             # refused before any was planned
            return
        waves = self.workload.stop_waves(list(by_name))[:count]
        stop_in_waves([[(n, by_name[n].proc) for n in wave if by_name[n].proc is not None] for wave in waves],
                      STOP_TIMEOUT)

    def close(self) -> None:
        """Every member stopped, and where they ran (emulated hosts) removed."""
        try:
            self.stop_waves()
        finally:
            self.placement.close()



def final_checkpoint(roster: Roster) -> None:
    """Once the workers have stopped (their final positions are with the leader), before the
    servers stop: the last state of everything, in one checkpoint, asked of ``roster``'s leader."""
    leader = next(m for m in roster.members if m.name == roster.leader)
    try:
        with SidecarClient(leader.url, token=roster.token, timeout=FINAL_CHECKPOINT_TIMEOUT) as c:
            result = asked_while_busy(c.checkpoint, FINAL_CHECKPOINT_TIMEOUT)
        roster.emit({"event": "checkpoint", "id": result["id"], "step": result["step"], "path": result["path"]})
    except Exception as exc:  # noqa: BLE001 - stopping must go on; the previous checkpoint stays valid
        if _stopping_itself(leader):
            # Signalled with everyone else (`scancel` signals every member of a job): the
            # servers take their own final checkpoint on the way out.
            roster.emit({"event": "warning", "message": f"{roster.leader} was stopping already; the servers' own "
                                                        "final checkpoint stands for this one"})
        else:
            roster.fail(f"final checkpoint failed: {exc}")


def asked_while_busy(ask: Callable[[], dict], within: float, every: float = 0.2) -> dict:
    """``ask()``, asked again while a checkpoint under way refuses it (409: a periodic one that
    fell as the workers stopped, which may have been taken before their final positions came),
    for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            return ask()
        except SidecarError as exc:
            if exc.status != 409 or time.monotonic() + every > deadline:
                raise
        time.sleep(every)  # noqa: sleep-ok (the one under way ends by itself; bounded by the deadline)


def _stopping_itself(m: Member, within: float = 10.0) -> bool:
    if m.proc is None:
        return False
    try:
        m.proc.wait(within)
        return True
    except subprocess.TimeoutExpired:
        return False


def cluster_record(roster: Roster) -> dict[str, Any]:
    """What ``cluster.json`` says of a run: each member's sidecar, role and handle (``Placed.describe``),
    those failing, those answering, and the placement's hosts."""
    members = roster.members
    state = {"sidecars": {m.name: m.url for m in members}, "roles": {m.name: m.role for m in members},
             "leader": roster.leader, "launcher_pid": os.getpid(), "run_on": roster.cfg.run_on,
             "checkpoint_dir": str(roster.checkpoint_dir.resolve()),
             "pids": {m.name: m.proc.pid for m in members if m.proc}, "master_port": roster.master_port,
             "placed": {m.name: m.proc.describe() for m in members if m.proc},
             "failing": {m.name: f for m in members if (f := m.failing()) is not None},
             "answering": [m.name for m in members if m.answering]}
    if (hosts := roster.placement.describe()) is not None:
        state["hosts"] = hosts
    return state


class LeaderWants:
    """The members the leader wants while the run goes on (a workload whose members change, its
    ``Launch.members``): those missing started, each other one's flags as planned now, and one
    that stops with exit 0 and is wanted no more let go instead of started again."""

    def __init__(self, workload: Launch, leader: str, roster: Roster, liveness: Any,
                 emit: Callable[[dict], None]) -> None:
        self._wants = getattr(workload, "members", None)
        self.leader, self.roster, self.liveness, self.emit = leader, roster, liveness, emit
        self.wanted: Optional[set[str]] = None        # as the leader last said
        self.last_change: dict[str, Any] = {}        # the leader's last change of layout, as it last said
        self.changes = ChangeEvents(emit)

    def update(self) -> None:
        leader = next((m for m in self.roster.members if m.name == self.leader), None)
        if self._wants is None or leader is None or leader.restart_at is not None:
            return
        try:
            with SidecarClient(leader.url, timeout=2.0) as c:
                status = c.status()
            wanted = self._wants(status)
        except Exception:  # noqa: BLE001 - restarting or busy: asked again at the next poll
            return
        self.changes.seen(status.get("change"))
        self.last_change = status.get("change") or {}
        if wanted is None:
            return
        self.wanted = {p.name for p in wanted}
        have = {m.name for m in self.roster.members}
        for planned in wanted:
            if planned.name in have:
                self.roster.replan(planned)
                continue
            m = self.roster.add(planned)
            self.liveness.watch(m.name, m.url)
            self.emit({"event": "scale", "name": m.name, "action": "started", "sidecar": m.url})

    def unwanted(self, m: Member, code: int) -> bool:
        """Whether ``m``, which stopped with ``code``, is one of the leader's role it wants no more
        (asked again now: it may have stopped a moment after the leader's layout changed): let go
        if it stopped with exit 0, or by any cause once the leader's last change moved the job off
        it (a drained server killed as it leaves: started again, it would hold nothing for good).
        A server lost before it held anything (the new one of a change that failed) is replaced."""
        self.update()
        if self.wanted is None or m.role != next(x.role for x in self.roster.members if x.name == self.leader) \
                or m.name in self.wanted:
            return False
        change = self.last_change
        left = change.get("state") == "done" and m.name in change.get("from", ()) and m.name not in change.get("to", ())
        if code != 0 and not left:
            return False
        self.roster.remove(m)
        self.emit({"event": "scale", "name": m.name, "action": "stopped",
                   "reason": "it holds nothing in the leader's layout"})
        return True


class ChangeEvents:
    """The leader's changes of layout, as its ``/status`` shows the last one, told as events:
    ``move`` once one is under way, ``moved`` once it ended (done or failed), each once per
    attempt (a failed attempt and the next share their epoch, not their name)."""

    FIELDS = ("epoch", "from", "to", "moved_slots", "moved_units")
    ENDED = ("state", "ahead_bytes", "ahead_seconds", "bytes", "pause_seconds", "seconds", "not_rebuilt", "error")

    def __init__(self, emit: Callable[[dict], None]) -> None:
        self.emit = emit
        self._began: set[str] = set()
        self._ended: set[str] = set()

    def seen(self, change: Optional[dict]) -> None:
        attempt = (change or {}).get("attempt")
        if attempt is None or attempt in self._ended:
            return
        if attempt not in self._began:       # one that ended between two polls is told begun first
            self._began.add(attempt)
            self.emit({"event": "move", **{k: change[k] for k in self.FIELDS if k in change}})
        if change.get("state") in ("done", "failed"):
            self._ended.add(attempt)
            self.emit({"event": "moved", "epoch": change["epoch"], **{k: change[k] for k in self.ENDED if k in change}})


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
