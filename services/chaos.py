"""``rpcps chaos``: kill or freeze members of a cluster ``rpcps up`` runs here, and report how it
recovers.

Faults come at random intervals (exponential, mean ``--interval``), a bounded number of times,
each to one member's process: ``--fault kill`` (SIGKILL), or ``--fault stop`` (SIGSTOP, then
SIGCONT after ``--for`` seconds, unless ``rpcps up`` has declared the member lost and replaced it
by then: ``--member-timeout``). After each, it waits until the member runs again and every member
is ready, then records what the fault cost, when the member was replaced (a frozen one: when
``rpcps up`` detected it) and when it counted its next step (an update applied, for a server; a
step taken, for a trainer). It only reads what ``rpcps up`` publishes (``cluster.json``) and what
the sidecars answer; the launcher does the detecting and restarting.

"Steps lost" is, for a server, the updates its restored shard lacks (its steps at the kill less the
step it resumed from: the checkpoint's, or its own handover's when the leader died); for a trainer,
the steps it takes again (it resumes its position from the checkpoint).
"""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from pydantic import Field

from services.checkpoint.store import CheckpointStore
from services.client import SidecarClient
from services.config import ConfigBase

POLL = 0.2


class ChaosConfig(ConfigBase):
    """``rpcps chaos``: what to kill or freeze, how often, how many times."""

    state_dir: Path = Field(Path(".rpcps"), description="where `rpcps up` wrote cluster.json")
    kills: int = Field(10, ge=1, le=10_000, description="faults in all", json_schema_extra={"env": "RPCPS_CHAOS_KILLS"})
    fault: Literal["kill", "stop"] = Field("kill", description="kill: SIGKILL a member; stop: freeze it (SIGSTOP) "
                                                               "for --for seconds, or until rpcps up replaces it")
    for_seconds: float = Field(30.0, gt=0, le=3600, json_schema_extra={"flag": "--for"},
                               description="--fault stop: seconds a member stays frozen unless replaced first")
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


class Chaos:
    def __init__(self, cfg: ChaosConfig, cluster: Cluster, emit: Callable[[dict], None],
                 kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL),
                 clock: Callable[[], float] = time.time, pause: Callable[[float], None] = time.sleep,
                 send: Callable[[int, int], None] = lambda pid, sig: _send(pid, sig)) -> None:
        self.cfg, self.cluster, self.emit = cfg, cluster, emit
        self._kill, self._clock, self._pause, self._send = kill, clock, pause, send
        self._rng = random.Random(cfg.seed)

    def candidates(self) -> list[str]:
        state = self.cluster.state()
        names = list(state["pids"])
        if self.cfg.members:
            wanted = [n.strip() for n in self.cfg.members.split(",") if n.strip()]
            unknown = [n for n in wanted if n not in names]
            if unknown:
                raise SystemExit(f"rpcps chaos: --members: {', '.join(unknown)} not in this cluster ({', '.join(names)})")
            return wanted
        return [n for n in names if n != state.get("leader")]

    def run(self) -> dict[str, Any]:
        if self.cfg.fault == "stop" and self.cluster.state().get("hosts"):
            raise SystemExit("rpcps chaos: --fault stop freezes a process of this machine, and this cluster's members "
                             "run on emulated hosts or Slurm nodes, behind the process rpcps up started (unshare, "
                             "srun): not there yet; --fault kill works on them")
        choices = self.candidates()
        records = []
        for k in range(self.cfg.kills):
            self._pause(self._rng.expovariate(1.0 / self.cfg.interval))
            records.append(self.fault_one(self._rng.choice(choices)))
            self.emit({"event": "kill", **records[-1]})
        summary = summarize(records)
        self.emit({"event": "summary", **summary})
        return summary

    def fault_one(self, name: str) -> dict[str, Any]:
        state = self.cluster.state()
        pid, leader = state["pids"][name], state.get("leader")
        before = _steps(self.cluster.status(name))
        checkpoint = self.cluster.newest_checkpoint()
        killed_at = self._clock()
        stop = self.cfg.fault == "stop"
        deadline = killed_at + self.cfg.for_seconds * stop + self.cfg.recover_timeout
        replaced_at: Optional[float] = None
        frozen = stop
        if stop:
            self._send(pid, signal.SIGSTOP)
        else:
            self._kill(pid)
        try:
            while True:
                now = self.cluster.state()
                if replaced_at is None and now["pids"].get(name) != pid:
                    replaced_at = self._clock()
                if frozen and replaced_at is None and self._clock() - killed_at >= self.cfg.for_seconds:
                    self._send(pid, signal.SIGCONT)       # not replaced in time: it goes on where it was
                    frozen = False
                if (replaced_at is not None or stop and not frozen) and all(self.cluster.ready(n) for n in now["pids"]):
                    break
                if self._clock() > deadline:
                    return {"member": name, "fault": self.cfg.fault, "killed_at": killed_at, "back_at": None,
                            "seconds": None, "error": f"not back within {self.cfg.recover_timeout:.0f}s"}
                self._pause(POLL)
        finally:
            if frozen and replaced_at is None:      # never left frozen, whatever happened here
                self._send(pid, signal.SIGCONT)
        back_at = self._clock()
        after = self.cluster.status(name) or {}
        # A member frozen and continued, not replaced, restored nothing: it goes on where it was.
        resumed = (after.get("resumed_from") or {}) if replaced_at is not None else {}
        resumed_step = resumed.get("step") if resumed else _steps(after) if replaced_at is not None else before
        stepping = self._next_step(name, _steps(after), deadline)
        record = {"member": name, "fault": self.cfg.fault, "killed_at": killed_at, "back_at": back_at,
                  "seconds": round(back_at - killed_at, 2), "replaced": replaced_at is not None,
                  "detected_seconds": round(replaced_at - killed_at, 2) if stop and replaced_at is not None else None,
                  "next_step_seconds": round(stepping - killed_at, 2) if stepping is not None else None,
                  "steps_before": before, "resumed_from": resumed.get("id"), "resumed_step": resumed_step,
                  "steps_lost": max(0, before - resumed_step) if before is not None and resumed_step is not None else None,
                  "checkpoint_at_kill": checkpoint["id"] if checkpoint else None,
                  # A server or the leader restores its state: steps it had taken are lost. A trainer
                  # goes on from its saved position: its steps since are taken again.
                  "restores": name == leader or name.startswith("ps")}
        if name == leader:
            record["kept_by"] = sorted(n for n in now["pids"] if n != name
                                       and ((self.cluster.status(n) or {}).get("resumed_from") or {}).get("handover"))
        return record

    def _next_step(self, name: str, back: Optional[int], deadline: float) -> Optional[float]:
        """When ``name`` (a server: its updates; a trainer: its steps) counted a step past ``back``;
        None if it does not by the deadline (an idle cluster, or no count to read)."""
        while back is not None and self._clock() <= deadline:
            now = _steps(self.cluster.status(name))
            if now is not None and now > back:
                return self._clock()
            self._pause(POLL)
        return None


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:      # replaced meanwhile: nothing left to continue
        pass


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
    if e["event"] == "kill":
        did = "froze" if e.get("fault") == "stop" else "killed"
        if e.get("back_at") is None:
            return f"{did} {e['member']}: {e['error']}"
        if e.get("fault") == "stop" and not e.get("replaced"):
            stepping = "" if e.get("next_step_seconds") is None else f", stepping again after {e['next_step_seconds']:.1f}s"
            return f"froze {e['member']}: not replaced, going on after {e['seconds']:.1f}s{stepping}"
        detected = f"declared lost and replaced after {e['detected_seconds']:.1f}s, " \
            if e.get("detected_seconds") is not None else ""
        lost = "" if e.get("steps_lost") is None else f", {e['steps_lost']} steps lost"
        kept = f", shards kept by {', '.join(e['kept_by'])}" if e.get("kept_by") else ""
        stepping = "" if e.get("next_step_seconds") is None else f", stepping again after {e['next_step_seconds']:.1f}s"
        return (f"{did} {e['member']}: {detected}back in {e['seconds']:.1f}s{stepping} (resumed from "
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
