"""``rpcps chaos``: kill, freeze or cut off members of a cluster ``rpcps up`` runs here, and report
how it recovers.

Faults come at random intervals (exponential, mean ``--interval``), a bounded number of times,
each to one member, through the handle its placement recorded in ``cluster.json``
(``supervise/placement``), wherever it runs: ``--fault kill`` (SIGKILL); ``--fault stop`` (SIGSTOP,
then SIGCONT after ``--for`` seconds, unless ``rpcps up`` has declared the member lost and
replaced it by then: ``--member-timeout``); ``--fault partition`` (its host's link down for
``--for`` seconds, its process running on; emulated hosts only); ``--fault scale`` (the job moved
onto one parameter server more or one fewer: ``supervise/chaos_scale.py``; ``--fault scale-kill``, with a
member of the change killed as it moves). After each, it waits until the
member runs again and every member is ready, then records what the fault cost, when the member
was replaced (a frozen or cut-off one: when ``rpcps up`` detected it), when it counted its next
step (an update applied, for a server; a step taken, for a trainer), and for a partition whether
that came while the link was still down. It only reads what ``rpcps up`` publishes
(``cluster.json``) and what the sidecars answer; the launcher does the detecting and restarting.

"Steps lost" is, for a server, the updates its restored shard lacks (its steps at the kill less the
step it resumed from: the checkpoint's, or its own handover's when the leader died); for a trainer,
the steps it takes again (a CTR trainer resumes after its last batch every server applied, a
language model's from the checkpoint).
"""
from __future__ import annotations

import functools
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from pydantic import Field

from supervise.chaos_scale import Rescales
from supervise.chaos_scale import human as scale_human
from supervise.chaos_scale import summarize as scale_summary
from services.checkpoint.store import CheckpointStore
from services.client import SidecarClient
from services.config import ConfigBase
from supervise.placement import Placed, found, placed_of

POLL = 0.2


class ChaosConfig(ConfigBase):
    """``rpcps chaos``: what to kill or freeze, how often, how many times."""

    state_dir: Path = Field(Path(".rpcps"), description="where `rpcps up` wrote cluster.json")
    kills: int = Field(10, ge=1, le=10_000, description="faults in all", json_schema_extra={"env": "RPCPS_CHAOS_KILLS"})
    fault: Literal["kill", "stop", "partition", "scale", "scale-kill"] = Field(
        "kill", description="kill: SIGKILL a member; stop: freeze it (SIGSTOP) for --for seconds, or until rpcps up "
                            "replaces it; partition: cut its host's link for --for seconds (--emulate-hosts); "
                            "scale: move the job onto one parameter server more or one fewer; scale-kill: the "
                            "same, with a source, a destination, the leader or a trainer killed as it moves")
    for_seconds: float = Field(30.0, gt=0, le=3600, json_schema_extra={"flag": "--for"},
                               description="--fault stop: seconds a member stays frozen unless replaced first; "
                                           "--fault partition: seconds its link stays down")
    interval: float = Field(20.0, gt=0, json_schema_extra={"env": "RPCPS_CHAOS_INTERVAL"},
                            description="mean seconds between kills (the gaps are exponentially distributed)")
    members: Optional[str] = Field(None, json_schema_extra={"env": "RPCPS_CHAOS_MEMBERS"},
                                   description="comma-separated members to choose from (default: all but the leader)")
    seed: Optional[int] = Field(None, description="seed of the choices and gaps (default: random)",
                                json_schema_extra={"env": "RPCPS_CHAOS_SEED"})
    recover_timeout: float = Field(180.0, gt=0, json_schema_extra={"env": "RPCPS_CHAOS_RECOVER_TIMEOUT"},
                                   description="seconds a kill may take to recover before chaos gives up")
    as_json: bool = Field(False, description="print JSON lines", json_schema_extra={"flag": "--json", "env": "RPCPS_JSON"})


class Cluster:
    """A running ``rpcps up`` cluster, as its ``cluster.json`` and sidecars show it."""

    def __init__(self, state_dir: Path, token: Optional[str] = None) -> None:
        self.path = Path(state_dir) / "cluster.json"
        self.token = token
        if not self.path.is_file():
            raise SystemExit(f"rpcps chaos: no {self.path}: is a cluster running (rpcps up --state-dir ...)?")

    def state(self) -> dict[str, Any]:
        return json.loads(self.path.read_text())

    def status(self, name: str) -> Optional[dict[str, Any]]:
        return self._ask(name, lambda c: c.status(), None)

    def ready(self, name: str) -> bool:
        return self._ask(name, lambda c: c.ready(), False)

    def _ask(self, name: str, call: Callable[[SidecarClient], Any], otherwise: Any) -> Any:
        """``call`` on ``name``'s sidecar; ``otherwise`` while it is restarting, or gone."""
        try:
            with SidecarClient(self.state()["sidecars"][name], token=self.token, timeout=2.0) as c:
                return call(c)
        except Exception:  # noqa: BLE001
            return otherwise

    def newest_checkpoint(self) -> Optional[dict[str, Any]]:
        folder = self.state().get("checkpoint_dir")
        found = CheckpointStore(Path(folder)).list() if folder else []
        return {"id": found[0].id, "step": found[0].step} if found else None


def _steps(status: Optional[dict[str, Any]]) -> Optional[int]:
    if not status:
        return None
    value = status.get("steps", status.get("step"))
    return int(value) if isinstance(value, (int, float)) else None


def handle_of(state: dict[str, Any], name: str) -> Placed:
    """Member ``name``'s handle, as its placement recorded it."""
    return found(placed_of(state)[name])


class _Fault:
    """One fault in progress on one start of a member: done to it, and undone (continued,
    reconnected) at the latest when ``undo`` is called, whatever happened meanwhile."""

    def __init__(self, kind: str, target: Placed, clock: Callable[[], float]) -> None:
        self.kind, self.target, self.pending, self._clock = kind, target, kind != "kill", clock
        self.undone_at: Optional[float] = None

    def do(self) -> None:
        if self.kind == "kill":
            self.target.kill()
        elif self.kind == "stop":
            self.target.send_signal(signal.SIGSTOP)
        else:
            self.target.connect(False)

    def undo(self) -> None:
        if self.pending:
            self.pending = False
            self.undone_at = self._clock()
            if self.kind == "stop":
                self.target.send_signal(signal.SIGCONT)
            else:
                self.target.connect(True)


class Chaos:
    def __init__(self, cfg: ChaosConfig, cluster: Cluster, emit: Callable[[dict], None],
                 clock: Callable[[], float] = time.time, pause: Callable[[float], None] = time.sleep,
                 handle: Callable[[dict, str], Placed] = handle_of) -> None:
        self.cfg, self.cluster, self.emit = cfg, cluster, emit
        self._clock, self._pause, self._handle = clock, pause, handle
        self._rng = random.Random(cfg.seed)

    def candidates(self) -> list[str]:
        state = self.cluster.state()
        names = list(placed_of(state))
        if self.cfg.members:
            wanted = [n.strip() for n in self.cfg.members.split(",") if n.strip()]
            unknown = [n for n in wanted if n not in names]
            if unknown:
                raise SystemExit(f"rpcps chaos: --members: {', '.join(unknown)} not in this cluster ({', '.join(names)})")
            return wanted
        return [n for n in names if n != state.get("leader")]

    def run(self) -> dict[str, Any]:
        if self.cfg.fault in ("scale", "scale-kill"):
            during = functools.partial(self.fault_one, kind="kill") if self.cfg.fault == "scale-kill" else None
            records = Rescales(self.cluster, self._rng, self._pause, self.cfg.interval, during=during,
                               clock=self._clock).run(self.cfg.kills)
            for r in records:
                self.emit({"event": "kill", **r})
            summary = scale_summary(records)
            self.emit({"event": "summary", **summary})
            return summary
        choices = self.candidates()
        if self.cfg.fault == "partition":
            state = self.cluster.state()
            local = [n for n in choices if not self._handle(state, n).cuttable]
            if local:
                raise SystemExit(f"rpcps chaos: --fault partition cuts a host's link, and {', '.join(local)} run on "
                                 f"no host of their own: start the cluster with rpcps up --emulate-hosts")
        records = []
        for k in range(self.cfg.kills):
            self._pause(self._rng.expovariate(1.0 / self.cfg.interval))
            records.append(self.fault_one(self._rng.choice(choices)))
            self.emit({"event": "kill", **records[-1]})
        summary = summarize(records)
        self.emit({"event": "summary", **summary})
        return summary

    def fault_one(self, name: str, kind: Optional[str] = None) -> dict[str, Any]:
        """``kind`` (default: ``--fault``'s) done to ``name``, and how it came back."""
        kind = kind or self.cfg.fault
        state = self.cluster.state()
        start, leader = placed_of(state)[name], state.get("leader")
        before = _steps(self.cluster.status(name))
        checkpoint = self.cluster.newest_checkpoint()
        fault = _Fault(kind, self._handle(state, name), self._clock)
        killed_at = self._clock()
        lasts = self.cfg.for_seconds if fault.pending else 0.0
        deadline = killed_at + lasts + self.cfg.recover_timeout
        fault.do()
        try:
            replaced_at = self._until_back(name, start, fault, killed_at, deadline)
            if replaced_at is False:
                return {"member": name, "fault": kind, "killed_at": killed_at, "back_at": None,
                        "seconds": None, "error": f"not back within {self.cfg.recover_timeout:.0f}s"}
            back_at = self._clock()
            after = self.cluster.status(name) or {}
            # A partition lasts its --for, replaced or not: did the job step while it lasted?
            stepping = self._next_step(name, _steps(after), killed_at + lasts if fault.pending else deadline)
            while fault.pending and self._clock() - killed_at < lasts:
                self._pause(POLL)
        finally:
            fault.undo()
        undone_at = fault.undone_at or self._clock()
        if stepping is None:
            stepping = self._next_step(name, _steps(after), deadline)
        # A member frozen and continued, not replaced, restored nothing: it goes on where it was.
        resumed = (after.get("resumed_from") or {}) if replaced_at is not None else {}
        resumed_step = resumed.get("step") if resumed else _steps(after) if replaced_at is not None else before
        record = {"member": name, "fault": kind, "killed_at": killed_at, "back_at": back_at,
                  "seconds": round(back_at - killed_at, 2), "replaced": replaced_at is not None,
                  "detected_seconds": round(replaced_at - killed_at, 2) if lasts and replaced_at is not None else None,
                  "next_step_seconds": round(stepping - killed_at, 2) if stepping is not None else None,
                  "steps_before": before, "resumed_from": resumed.get("id"), "resumed_step": resumed_step,
                  "steps_lost": max(0, before - resumed_step) if before is not None and resumed_step is not None else None,
                  "checkpoint_at_kill": checkpoint["id"] if checkpoint else None,
                  # A server or the leader restores its state: steps it had taken are lost. A trainer
                  # goes on from its saved position: its steps since are taken again.
                  "restores": name == leader or name.startswith("ps")}
        if lasts:
            record.update(lasted_seconds=round(undone_at - killed_at, 2),
                          stepped_during=stepping is not None and stepping < undone_at,
                          old_running=replaced_at is not None and fault.target.poll() is None)
        if name not in placed_of(self.cluster.state()):
            record["let_go"] = True     # it was leaving the job (a drained server): not started again
        if name == leader:
            record["kept_by"] = sorted(n for n in placed_of(self.cluster.state()) if n != name
                                       and ((self.cluster.status(n) or {}).get("resumed_from") or {}).get("handover"))
        return record

    def _until_back(self, name: str, start: dict[str, Any], fault: _Fault, at: float, deadline: float) -> Any:
        """When ``name`` was replaced (None: it was not, and goes on where it was) once every member
        is ready again; False past the deadline. A frozen member not replaced within --for is
        continued; a cut-off one is reconnected after --for, replaced or not."""
        replaced_at: Optional[float] = None
        while True:
            now = placed_of(self.cluster.state())
            if replaced_at is None and now.get(name) != start:
                replaced_at = self._clock()
                if fault.kind == "stop":
                    fault.pending = False       # stopped for good where it was: nothing to continue
            if fault.pending and replaced_at is None and self._clock() - at >= self.cfg.for_seconds:
                fault.undo()
            if (replaced_at is not None or fault.kind != "kill" and not fault.pending) and \
                    all(self.cluster.ready(n) for n in now):
                return replaced_at
            if self._clock() > deadline:
                return False
            self._pause(POLL)

    def _next_step(self, name: str, back: Optional[int], deadline: float) -> Optional[float]:
        """When ``name`` (a server: its updates; a trainer: its steps) counted a step past ``back``;
        None if it does not by the deadline (an idle cluster, or no count to read)."""
        while back is not None and self._clock() <= deadline:
            now = _steps(self.cluster.status(name))
            if now is not None and now > back:
                return self._clock()
            self._pause(POLL)
        return None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    back = [r["seconds"] for r in records if r.get("seconds") is not None]
    stepping = [r["next_step_seconds"] for r in records if r.get("next_step_seconds") is not None]
    by_member: dict[str, int] = {}
    for r in records:
        by_member[r["member"]] = by_member.get(r["member"], 0) + 1
    return {"kills": len(records), "recovered": len(back), "by_member": by_member,
            "median_seconds": statistics.median(back) if back else None, "max_seconds": max(back) if back else None,
            "median_next_step_seconds": statistics.median(stepping) if stepping else None,
            "steps_lost": sum(r.get("steps_lost") or 0 for r in records if r.get("restores")),
            "steps_repeated": sum(r.get("steps_lost") or 0 for r in records if not r.get("restores"))}


def human(e: dict[str, Any]) -> str:
    if e.get("fault") in ("scale", "scale-kill"):
        return scale_human(e)
    if e["event"] == "kill":
        did = {"stop": "froze", "partition": "cut off"}.get(e.get("fault"), "killed")
        if e.get("back_at") is None:
            return f"{did} {e['member']}: {e['error']}"
        stepping = "" if e.get("next_step_seconds") is None else f", stepping again after {e['next_step_seconds']:.1f}s"
        if e.get("fault") != "kill" and not e.get("replaced"):
            return f"{did} {e['member']}: not replaced, going on after {e['seconds']:.1f}s{stepping}"
        detected = f"declared lost and replaced after {e['detected_seconds']:.1f}s, " \
            if e.get("detected_seconds") is not None else ""
        lost = "" if e.get("steps_lost") is None else f", {e['steps_lost']} steps lost"
        kept = f", shards kept by {', '.join(e['kept_by'])}" if e.get("kept_by") else ""
        during = " while its link was still down" if e.get("fault") == "partition" and e.get("stepped_during") else ""
        return (f"{did} {e['member']}: {detected}back in {e['seconds']:.1f}s{stepping}{during} (resumed from "
                f"{e.get('resumed_from') or '-'}{lost}{kept})")
    return (f"{e['kills']} kills, {e['recovered']} recovered; back in a median {e['median_seconds']}s (max "
            f"{e['max_seconds']}s), stepping again after a median {e['median_next_step_seconds']}s; "
            f"server steps lost {e['steps_lost']}, trainer steps repeated {e['steps_repeated']}")


def run_chaos(cfg: ChaosConfig) -> int:
    def emit(event: dict) -> None:
        print(json.dumps(event) if cfg.as_json else human(event), flush=True)
    cluster = Cluster(cfg.state_dir, os.environ.get("RPCPS_CONTROL_TOKEN") or None)
    summary = Chaos(cfg, cluster, emit).run()
    return 0 if summary["recovered"] == summary["kills"] else 1
