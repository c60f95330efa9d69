"""Consistent cluster checkpoints: the protocol and the layout, in one place.

The leader (ps0; the RL agent, a cluster of one) coordinates. One checkpoint, over the members
its ``CheckpointPlan`` names (their ``CheckpointMember`` services, ``member.py``):

0. every holder prepares buffers for its copy (allocating memory is the slow part of copying it);
1. every member of the paused role (the trainers) is held at its next step boundary and answers
   its position;
2. every holder copies its snapshot parts (parameters, optimizer state, step) at that quiet instant;
3. the paused members go on: training stops only for steps 1-3;
4. every holder writes its copies, the coordinator writes the positions, and the manifest is written
   last (``store.py``), so a crash at any moment leaves the previous checkpoint the newest valid one.

With ``--full-checkpoint-every N``, N - 1 of every N checkpoints are deltas: a part that saved in
the newest checkpoint writes only what changed since (a server's changed rows, ``ps/server/delta.py``),
and the manifest names, under ``meta.delta``, the checkpoint each such file applies to. A restore
applies them in order to the whole file they chain back to; pruning keeps what a kept one needs.

Any sidecar's ``POST /checkpoint`` ends up in ``Coordinator.take`` on the leader.

Where the files go: each holder writes into its own checkpoint folder. When that is one folder
shared by all (``rpcps up``, one compose volume), a step's folder holds every file and one
manifest. When each has a volume of its own (a Kubernetes StatefulSet's ``volumeClaimTemplates``),
a holder finds no marker of the leader's in its folder, so it writes a manifest of its own beside
its files, and the leader's manifest records them under ``meta.elsewhere``. The leader's manifest
is written last either way: it is what makes a step the cluster's checkpoint.

Which checkpoint a cluster resumes is the leader's choice alone: it announces the one it restored
(and each one it commits) in the rendezvous store, and every other holder restores exactly that
one, so parts of different steps never mix (``follow_leader``). The one exception is a new leader
after a lost one: a server that kept its newer shard then keeps it (``handover.py``).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar

from services.checkpoint.handover import Standing
from services.checkpoint.member import OWN_MANIFEST_KEY, CheckpointMember, marker
from services.checkpoint.store import CheckpointInfo, CheckpointStore, FileEntry
from services.errors import CheckpointError, CheckpointInProgress, NotReady
from services.membership import current_members
from services.names import parse_name
from services.remote import Service, call, remote

log = logging.getLogger(__name__)
T = TypeVar("T")

PAUSE_TIMEOUT = 60.0       # a trainer reaches a step boundary well within this
TAKE_TIMEOUT = 600.0       # a whole checkpoint, as seen by a member that asked the leader for one
CLUSTER_CHECKPOINT_KEY = "rpcps/checkpoint"   # in the rendezvous store: a ``Standing``, as JSON


@dataclass(frozen=True)
class CheckpointPlan:
    """Who takes part in the cluster's checkpoints, and what every manifest says of the cluster."""

    holders: tuple[str, ...]          # members whose snapshot parts every checkpoint needs
    paused_role: Optional[str] = None  # present members of this role are held, and their positions saved
    meta: dict[str, Any] = field(default_factory=dict)


class ToldPositions:
    """Positions members told the leader themselves (``Coordinator.tell``), the newest per member.
    Of a told and a saved position, the one with more ``steps`` is newer: a member's steps only
    grow, across its restarts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._told: dict[str, dict[str, Any]] = {}

    def tell(self, name: str, state: dict[str, Any]) -> None:
        with self._lock:
            self._told[name] = state

    def newest(self, saved: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``saved`` (positions by member), each replaced by its member's told one when that is newer."""
        with self._lock:
            told = dict(self._told)
        newer = {name: state for name, state in told.items()
                 if name not in saved or _steps(state) >= _steps(saved[name])}
        return {**saved, **newer}


def _steps(state: dict[str, Any]) -> int:
    try:
        return int(state.get("steps", -1))
    except (TypeError, ValueError):
        return -1


def announce(store: Any, standing: Standing) -> None:
    """The leader: publish where the cluster stands (in the rendezvous store) for holders that start later."""
    store.set(CLUSTER_CHECKPOINT_KEY, standing.to_json())


def follow_leader(store: Any, timeout: float) -> Standing:
    """A holder other than the leader: where the leader says the cluster stands (the checkpoint it
    restored or committed last, None for a fresh start)."""
    store.wait([CLUSTER_CHECKPOINT_KEY], datetime.timedelta(seconds=timeout))
    return Standing.from_json(store.get(CLUSTER_CHECKPOINT_KEY).decode())


def standing_now(read: Callable[[], str]) -> Optional[Standing]:
    """Where the leader last said the cluster stands (``read``: the value of ``CLUSTER_CHECKPOINT_KEY``);
    None if its store cannot say now."""
    try:
        return Standing.from_json(read())
    except Exception:  # noqa: BLE001 - a leader going away is the leader watch's to notice
        return None


def ask_coordinator(leader: str, method: Callable[..., Any], *args: Any, timeout: float = TAKE_TIMEOUT) -> Any:
    """From any member: run ``method`` (one of ``Coordinator``'s) on the leader's coordinator."""
    return call(leader, method, *args, timeout=timeout)


class Coordinator(Service):
    def __init__(self, store: CheckpointStore, plan: CheckpointPlan, keep: int, local: CheckpointMember,
                 metrics: Any, resumed: Optional[CheckpointInfo] = None,
                 on_commit: Callable[[CheckpointInfo], None] = lambda info: None,
                 members: Callable[[], list[str]] = current_members,
                 transport: Callable[..., Any] = call, full_every: int = 1) -> None:
        """``local``: the leader's own member, called directly. ``members`` lists the group and
        ``transport`` calls the others (``services.remote.call``; a unit test passes in-process ones).
        ``full_every``: every so many checkpoints one is whole; the others are deltas, each part
        saving only what changed since the checkpoint before (where it can)."""
        self.store, self.plan, self.keep, self.full_every = store, plan, keep, full_every
        self._metrics, self._on_commit = metrics, on_commit
        self._members, self._fan = members, Fanout(local, transport)
        self._lock = threading.Lock()       # one checkpoint at a time
        self.latest = resumed
        self._told = ToldPositions()

    # --- asked over RPC or HTTP ----------------------------------------------------------------------
    @remote
    def take(self) -> dict[str, Any]:
        if not self._lock.acquire(blocking=False):
            raise CheckpointInProgress("a checkpoint is being taken; ask again when it has finished")
        try:
            return self._take()
        finally:
            self._lock.release()

    @remote
    def take_unless_saved(self, step: int) -> dict[str, Any]:
        """A stopping holder's final checkpoint, unless the newest holds ``step``. One under way
        (``scancel`` stops all at once) is waited for, within the caller's bound, not refused."""
        with self._lock:
            latest = self.latest
            if latest is not None and latest.step >= step:
                return {**latest.describe(), "new": False}
            return self._take()

    @remote
    def listing(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.store.list()]

    @remote
    def positions(self) -> Optional[dict[str, Any]]:
        """The paused members' states in the newest checkpoint, or told since when newer (``tell``):
        ``{"checkpoint": id, "states": [...]}``, each member working out its own; None if none."""
        info = self.latest
        states = self._told.newest(self._saved_positions(info))
        if not states:
            return None
        return {"checkpoint": info.id if info is not None else "the positions told to the leader",
                "states": list(states.values())}

    @remote
    def tell(self, name: str, state: dict) -> None:
        """A paused member says where it is: stopping, so later checkpoints (the final one of `docker
        compose down`, which stops trainers first) still carry it; or waiting for data (a followed
        folder's trainer between files), so a replacement dying there goes on from exactly there."""
        if not self._is_position(f"{name}.pt"):
            raise CheckpointError(f"{name} is not a member whose position checkpoints keep")
        self._told.tell(name, state)

    def _saved_positions(self, info: Optional[CheckpointInfo]) -> dict[str, dict]:
        """The paused members' positions ``info`` saved, by member (none without it or its folder)."""
        if info is None or not info.path.exists():
            return {}
        return {n[:-3]: self.store.load_file(info, n) for n in sorted(info.files) if self._is_position(n)}

    def _is_position(self, file_name: str) -> bool:
        stem = file_name[:-3] if file_name.endswith(".pt") else ""
        try:
            return self.plan.paused_role is not None and parse_name(stem).role == self.plan.paused_role
        except ValueError:
            return False

    def paused(self, action: Callable[[], T]) -> tuple[T, float]:
        """``action`` while the paused role's members are held at a step boundary, as a
        checkpoint holds them, one at a time with checkpoints (a change of layout runs so): its
        result, and the seconds they were held."""
        with self._lock:
            started = time.monotonic()
            with self._holding(self._paused_members(self._members()), uuid.uuid4().hex):
                result = action()
            return result, time.monotonic() - started

    # --- the protocol ----------------------------------------------------------------------------------
    def _take(self) -> dict[str, Any]:
        with counted(self._metrics):
            members = self._members()
            holders = list(self.plan.holders)
            missing = sorted(set(holders) - set(members))
            if missing:
                raise NotReady(f"cannot checkpoint without {', '.join(missing)}")
            paused = self._paused_members(members)
            checkpoint_id = uuid.uuid4().hex
            committed = False
            try:
                result = self._take_with(checkpoint_id, holders, paused)
                committed = result["new"]      # not new: the newest already held this step, and stays it
                return result
            finally:
                self._fan.on_all(holders, CheckpointMember.discard, checkpoint_id, committed, self.keep)

    def _take_with(self, checkpoint_id: str, holders: list[str], paused: list[str]) -> dict[str, Any]:
        self._fan.on_all(holders, CheckpointMember.prepare, checkpoint_id)
        started = time.monotonic()
        with self._holding(paused, checkpoint_id) as positions:
            snapshots = self._fan.on_all(holders, CheckpointMember.snapshot, checkpoint_id, self._base())
        pause_seconds = time.monotonic() - started
        steps = {m: s["step"] for m, s in snapshots.items()}
        # Equal, unless a holder was restarted alone from an older checkpoint: the cluster's step is
        # the furthest any holder has come.
        step = max(steps.values())
        if len(set(steps.values())) != 1:
            log.warning("holders report different steps %s (one was restarted alone); checkpoint at %d", steps, step)
        if self.latest is not None and self.latest.step == step and self.latest.path.exists():
            return {**self.latest.describe(), "pause_seconds": pause_seconds, "new": False}
        meta = dict(self.plan.meta)
        for s in snapshots.values():
            meta.update(s["meta"])
        bases = {name: f"step-{base}" for s in snapshots.values() for name, base in s.get("bases", {}).items()}
        chain = int(self.latest.meta.get("chain", 0)) + 1 if bases else 0
        meta.update(kind="delta" if bases else "full", chain=chain, **({"delta": bases} if bases else {}))
        entries, elsewhere = self._write(checkpoint_id, step, holders, meta)
        # Newest first: held now, then a member gone (stopped, or crashed and not yet back) at the
        # newer of its last saved and its last told position, so that its restart does not read
        # its share again.
        positions = {**self._told.newest(self._saved_positions(self.latest)), **positions}
        for name, state in positions.items():
            entries.append(self.store.write_file(step, f"{name}.pt", state))
        meta = {**meta, "positions": sorted(positions), "pause_seconds": pause_seconds}
        if elsewhere:
            meta["elsewhere"] = elsewhere
        info = self.store.commit(step, entries, meta)
        self.latest = info
        self._on_commit(info)
        removed = self.store.prune(self.keep)
        log.info("checkpoint %s: %d files, %.1f MB, training paused %.3fs%s", info.id, len(info.files),
                 info.size / 1e6, pause_seconds, f"; removed {[p.name for p in removed]}" if removed else "")
        return {**info.describe(), "pause_seconds": pause_seconds, "new": True}

    def _base(self) -> Optional[int]:
        """The step of the checkpoint the next may be a delta against: the newest, unless it ends
        a run of ``full_every`` - 1 deltas since a whole one."""
        latest = self.latest
        if latest is None or int(latest.meta.get("chain", 0)) + 1 >= self.full_every or not latest.path.exists():
            return None
        return latest.step

    def _write(self, checkpoint_id: str, step: int, holders: list[str],
               meta: dict[str, Any]) -> tuple[list[FileEntry], dict[str, dict]]:
        """Every holder's files: those in the leader's folder, and those under manifests of their own."""
        folder = self.store.prepare(step)
        (folder / marker(checkpoint_id)).touch()
        entries: list[FileEntry] = []
        elsewhere: dict[str, dict] = {}
        for holder, written in self._fan.on_all(holders, CheckpointMember.write, checkpoint_id, step, meta).items():
            for entry, shared in written:
                if shared:
                    entries.append(entry)
                else:                         # on that holder's own volume, under its own manifest
                    elsewhere[entry.name] = {**entry.to_json(), OWN_MANIFEST_KEY: holder}
        (folder / marker(checkpoint_id)).unlink()
        return entries, elsewhere

    def _paused_members(self, members: list[str]) -> list[str]:
        return [m for m in members if self.plan.paused_role and parse_name(m).role == self.plan.paused_role]

    @contextlib.contextmanager
    def _holding(self, members: list[str], hold_id: str) -> Iterator[dict[str, dict]]:
        """``members`` held at a step boundary for the block (one that cannot be held, gone, is
        left out, with a log line); their positions."""
        positions: dict[str, dict] = {}
        held: list[str] = []
        try:
            for name, result in self._pause(members, hold_id).items():
                if isinstance(result, Exception):
                    log.warning("%s not held: %s", name, result)
                else:
                    held.append(name)
                    positions.update(result)
            yield positions
        finally:
            if held:
                self._resume(held, hold_id)

    def _resume(self, members: list[str], checkpoint_id: str) -> None:
        """Let the held members go on; one that left meanwhile has nothing to resume, and its
        position was taken when it was held."""
        for m, result in self._fan.on_each(members, CheckpointMember.resume, checkpoint_id).items():
            if isinstance(result, Exception):
                log.warning("could not resume %s (gone?): %s", m, str(result).splitlines()[0])

    def _pause(self, members: list[str], checkpoint_id: str) -> dict[str, Any]:
        """Hold every paused member; one that cannot be held (gone) is reported, not fatal."""
        return self._fan.on_each(members, CheckpointMember.pause, checkpoint_id, PAUSE_TIMEOUT, timeout=PAUSE_TIMEOUT + 10)

class Fanout:
    """One call of a member method on many members at once: the leader's own member directly,
    the others by ``transport``."""

    def __init__(self, local: CheckpointMember, transport: Callable[..., Any]) -> None:
        self._local, self._transport = local, transport

    def call(self, member: str, method: Callable[..., Any], *args: Any, timeout: float = TAKE_TIMEOUT) -> Any:
        if member == self._local.name:
            return getattr(self._local, method.__name__)(*args)
        return self._transport(member, method, *args, timeout=timeout)

    def on_all(self, members: list[str], method: Callable[..., Any], *args: Any,
               timeout: float = TAKE_TIMEOUT) -> dict[str, Any]:
        with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
            futures = {m: pool.submit(self.call, m, method, *args, timeout=timeout) for m in members}
            return {m: f.result() for m, f in futures.items()}

    def on_each(self, members: list[str], method: Callable[..., Any], *args: Any,
                timeout: float = TAKE_TIMEOUT) -> dict[str, Any]:
        """``method`` on every member at once; each one's result, or the exception it raised: a
        paused member (a trainer) that dies must not fail the checkpoint."""
        out: dict[str, Any] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
            futures = {m: pool.submit(self.call, m, method, *args, timeout=timeout) for m in members}
            for m, f in futures.items():
                try:
                    out[m] = f.result()
                except Exception as exc:  # noqa: BLE001 - reported to the caller, per member
                    out[m] = exc
        return out


@contextlib.contextmanager
def counted(metrics: Any) -> Iterator[None]:
    """Count a checkpoint attempt in the leader's metrics: its time when it succeeds, a failure
    when it fails (an overlapping request's 409 is neither)."""
    try:
        yield
    except CheckpointInProgress:
        raise
    except Exception:
        metrics.checkpoint_failures.inc()
        raise
    metrics.checkpoint_last_success.set(time.time())
