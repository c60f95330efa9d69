"""Consistent cluster checkpoints: the whole protocol, in one place.

ps0 coordinates (it already leads membership). One checkpoint:

0. every server prepares buffers for its copy (allocating memory is the slow part of copying it);
1. pause every trainer at its next step boundary; each answers with its position in its data;
2. every server copies its shard (parameters, optimizer state, step) at that quiet instant;
3. resume the trainers: training stops only for steps 1-3;
4. every server writes its copy, the coordinator writes the trainers' positions, and the manifest
   is written last (``services/checkpoint.py``), so a crash at any moment leaves the previous
   checkpoint the newest valid one.

Any sidecar's ``POST /checkpoint`` ends up in ``Coordinator.take`` on ps0.

Where the files go: each server writes into its own ``--checkpoint-dir``. When that is one folder
shared by all (``rpcps up``, one compose volume), a step's folder holds every file and one manifest.
When each server has a volume of its own (a Kubernetes StatefulSet's ``volumeClaimTemplates``), a
server finds no marker of ps0's in its folder, so it writes a manifest of its own beside its shard,
and ps0's manifest records that shard's checksum under ``meta.elsewhere``. ps0's manifest is written
last either way: it is what makes a step the cluster's checkpoint.

Which checkpoint a cluster resumes is ps0's choice alone: it announces the one it restored (and each
one it commits) in the rendezvous store, and every other server restores exactly that one, so shards
of different steps never mix (``follow_leader``).
"""
from __future__ import annotations

import abc
import contextlib
import datetime
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

from services.checkpoint import CheckpointInfo, CheckpointStore, FileEntry
from services.errors import CheckpointError, CheckpointInProgress, NotReady
from services.membership import current_members
from services.names import LEADER, parse_name, ps_names
from services.remote import Service, call, remote

log = logging.getLogger(__name__)

PAUSE_TIMEOUT = 60.0       # a trainer reaches a step boundary well within this
TAKE_TIMEOUT = 600.0       # a whole checkpoint, as seen by a member that asked ps0 for one


class ShardParticipant(Service, abc.ABC):
    """A server: what the coordinator asks of it (its shard is copied, written and discarded)."""

    @remote
    @abc.abstractmethod
    def ckpt_prepare(self, checkpoint_id: str) -> None:
        """Make the buffers the snapshot will be copied into (before the trainers are held)."""

    @remote
    @abc.abstractmethod
    def ckpt_snapshot(self, checkpoint_id: str) -> int:
        """Copy the shard at this instant; answer its step."""

    @remote
    @abc.abstractmethod
    def ckpt_write(self, checkpoint_id: str, step: int, meta: dict) -> tuple[FileEntry, bool]:
        """Write the copy; True when it went into ps0's folder, False under a manifest of its own."""

    @remote
    @abc.abstractmethod
    def ckpt_discard(self, checkpoint_id: str, committed: bool) -> None:
        """Drop the copy (and, unless ``committed``, anything written of it)."""


class PausableParticipant(Service, abc.ABC):
    """A trainer: held at a step boundary while the servers copy their shards."""

    @remote
    @abc.abstractmethod
    def ckpt_pause(self, checkpoint_id: str, timeout: float) -> dict:
        """Hold at the next step boundary (within ``timeout``) and answer this member's position."""

    @remote
    @abc.abstractmethod
    def ckpt_resume(self, checkpoint_id: str) -> None:
        """Go on training."""


CLUSTER_CHECKPOINT_KEY = "rpcps/checkpoint"   # in the rendezvous store: the cluster's checkpoint id, or ""


def marker(checkpoint_id: str) -> str:
    """The file ps0 leaves in a step's folder while it is written: a server that sees it shares the folder."""
    return f".taking-{checkpoint_id}"


def announce(store: Any, info: Optional[CheckpointInfo]) -> None:
    """ps0: publish the checkpoint the cluster stands on (in the rendezvous store) for servers that start later."""
    store.set(CLUSTER_CHECKPOINT_KEY, info.id if info is not None else "")


def follow_leader(store: Any, timeout: float) -> Optional[str]:
    """A server other than ps0: the checkpoint ps0 restored or committed last (None: it started fresh)."""
    store.wait([CLUSTER_CHECKPOINT_KEY], datetime.timedelta(seconds=timeout))
    ref = store.get(CLUSTER_CHECKPOINT_KEY).decode()
    return ref or None


def ask_coordinator(method: Callable[..., Any], *args: Any, timeout: float = TAKE_TIMEOUT) -> Any:
    """From any member: run ``method`` (one of ``Coordinator``'s) on ps0's coordinator."""
    return call(LEADER, method, *args, timeout=timeout)


class Coordinator(Service):
    def __init__(self, store: CheckpointStore, num_ps: int, meta: dict[str, Any], keep: int,
                 local: ShardParticipant, metrics: Any, resumed: Optional[CheckpointInfo] = None,
                 on_commit: Callable[[CheckpointInfo], None] = lambda info: None) -> None:
        self.store, self.num_ps, self.meta, self.keep = store, num_ps, meta, keep
        self._on_commit = on_commit
        self._metrics = metrics
        self._local = local            # ps0's own participant: called directly, not over RPC
        self._lock = threading.Lock()
        self.latest = resumed
        self._departed: dict[str, dict[str, Any]] = {}   # trainer name -> its position when it stopped
        self._departed_lock = threading.Lock()

    # --- asked over RPC or HTTP ----------------------------------------------------------------------
    @remote
    def take(self) -> dict[str, Any]:
        if not self._lock.acquire(blocking=False):
            raise CheckpointInProgress("a checkpoint is being taken; ask again when it has finished")
        try:
            with counted(self._metrics):
                return self._take()
        finally:
            self._lock.release()

    @remote
    def take_unless_saved(self, steps: int) -> dict[str, Any]:
        """A stopping server's final checkpoint: none when the newest already holds ``steps``
        (its shard has not moved since), which spares copying every shard for nothing."""
        latest = self.latest
        if latest is not None and latest.step >= steps:
            return {**latest.describe(), "new": False}
        return self.take()

    @remote
    def listing(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.store.list()]

    @remote
    def trainer_states(self) -> Optional[dict[str, Any]]:
        """The trainers' positions in the newest checkpoint this cluster knows (each trainer works
        out its own from them: ``trainer/position.py``)."""
        info = self.latest
        if info is None:
            return None
        names = [n for n in sorted(info.files) if re.fullmatch(r"trainer\d+\.pt", n)]
        return {"checkpoint": info.id, "trainers": [self.store.load_file(info, n) for n in names]}

    @remote
    def trainer_left(self, state: dict[str, Any]) -> None:
        """A trainer stopping says where it was, so checkpoints taken after it left (the final one
        of `docker compose down`, which stops trainers first) still carry its position."""
        name = state.get("name") if isinstance(state, dict) else None
        if not isinstance(name, str) or parse_name(name).role != "trainer":
            raise CheckpointError(f"trainer_left needs a trainer's position, got {type(state).__name__}")
        with self._departed_lock:
            self._departed[name] = state

    # --- the protocol ----------------------------------------------------------------------------------
    def _call(self, member: str, method: Callable[..., Any], *args: Any, timeout: float = TAKE_TIMEOUT) -> Any:
        if member == LEADER:
            return getattr(self._local, method.__name__)(*args)
        return call(member, method, *args, timeout=timeout)

    def _on_all(self, members: list[str], method: Callable[..., Any], *args: Any,
                timeout: float = TAKE_TIMEOUT) -> dict[str, Any]:
        with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
            futures = {m: pool.submit(self._call, m, method, *args, timeout=timeout) for m in members}
            return {m: f.result() for m, f in futures.items()}

    def _take(self) -> dict[str, Any]:
        members = current_members()
        servers = ps_names(self.num_ps)
        missing = sorted(set(servers) - set(members))
        if missing:
            raise NotReady(f"cannot checkpoint without {', '.join(missing)}")
        trainers = [m for m in members if parse_name(m).role == "trainer"]
        checkpoint_id = uuid.uuid4().hex
        committed = False
        try:
            result = self._take_with(checkpoint_id, servers, trainers)
            committed = True
            return result
        finally:
            self._on_all(servers, ShardParticipant.ckpt_discard, checkpoint_id, committed)

    def _take_with(self, checkpoint_id: str, servers: list[str], trainers: list[str]) -> dict[str, Any]:
        self._on_all(servers, ShardParticipant.ckpt_prepare, checkpoint_id)
        started = time.monotonic()
        paused: dict[str, dict] = {}
        try:
            for name, result in self._pause(trainers, checkpoint_id).items():
                if isinstance(result, Exception):
                    log.warning("checkpoint without %s: %s", name, result)
                else:
                    paused[name] = result
            steps = self._on_all(servers, ShardParticipant.ckpt_snapshot, checkpoint_id)
        finally:
            if paused:
                self._on_all(list(paused), PausableParticipant.ckpt_resume, checkpoint_id)
            pause_seconds = time.monotonic() - started
        # Equal, unless a server was restarted alone from an older checkpoint: the cluster's step is
        # the furthest any server has come.
        step = max(steps.values())
        if len(set(steps.values())) != 1:
            log.warning("servers report different steps %s (one was restarted alone); checkpoint at %d", steps, step)
        if self.latest is not None and self.latest.step == step and self.latest.path.exists():
            return {**self.latest.describe(), "pause_seconds": pause_seconds, "new": False}
        folder = self.store.prepare(step)
        (folder / marker(checkpoint_id)).touch()
        meta = {**self.meta, "num_ps": self.num_ps}
        entries: list[FileEntry] = []
        elsewhere: dict[str, dict] = {}
        for server, (entry, shared) in self._on_all(servers, ShardParticipant.ckpt_write, checkpoint_id, step, meta).items():
            if shared:
                entries.append(entry)
            else:                         # on that server's own volume, under its own manifest
                elsewhere[entry.name] = {**entry.to_json(), "server": server}
        (folder / marker(checkpoint_id)).unlink()
        with self._departed_lock:
            positions = {**{n: s for n, s in self._departed.items() if n not in paused}, **paused}
        for name, state in positions.items():
            entries.append(self.store.write_file(step, f"{name}.pt", state))
        meta = {**meta, "trainers": sorted(positions), "pause_seconds": pause_seconds}
        if elsewhere:
            meta["elsewhere"] = elsewhere
        info = self.store.commit(step, entries, meta)
        self.latest = info
        self._on_commit(info)
        removed = self.store.prune(self.keep)
        log.info("checkpoint %s: %d files, %.1f MB, training paused %.3fs%s", info.id, len(info.files),
                 info.size / 1e6, pause_seconds, f"; removed {[p.name for p in removed]}" if removed else "")
        return {**info.describe(), "pause_seconds": pause_seconds, "new": True}

    def _pause(self, trainers: list[str], checkpoint_id: str) -> dict[str, Any]:
        """Pause every trainer; a trainer that cannot be paused (gone) is reported, not fatal."""
        out: dict[str, Any] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(trainers))) as pool:
            futures = {t: pool.submit(self._call, t, PausableParticipant.ckpt_pause, checkpoint_id, PAUSE_TIMEOUT,
                                    timeout=PAUSE_TIMEOUT + 10)
                       for t in trainers}
            for t, f in futures.items():
                try:
                    out[t] = f.result()
                except Exception as exc:  # noqa: BLE001 - a dead trainer must not block the checkpoint
                    out[t] = exc
        return out


class Periodic:
    """Takes a checkpoint every N steps and/or M seconds (ps0). Survives any single failure."""

    def __init__(self, take: Callable[[], dict], steps_now: Callable[[], int], every_steps: Optional[int],
                 every_seconds: Optional[float]) -> None:
        self._take, self._steps_now = take, steps_now
        self._every_steps, self._every_seconds = every_steps, every_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoints", daemon=True)

    def start(self) -> "Periodic":
        if self._every_steps or self._every_seconds:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        last_time, last_steps = time.monotonic(), self._steps_now()
        while not self._stop.wait(0.5):
            due_steps = self._every_steps and self._steps_now() - last_steps >= self._every_steps
            due_time = self._every_seconds and time.monotonic() - last_time >= self._every_seconds
            if not (due_steps or due_time) or self._steps_now() == last_steps:
                continue
            try:
                result = self._take()
                last_time, last_steps = time.monotonic(), result["step"]
            except CheckpointInProgress:
                pass
            except Exception:  # keep the schedule alive; the next period tries again
                log.exception("periodic checkpoint failed")
                last_time = time.monotonic()


def restore(store: CheckpointStore, resume: bool, resume_from: Optional[str], model: dict[str, Any], shard: int,
            num_ps: int, build: Callable[[Optional[list]], Any]) -> tuple[Optional[CheckpointInfo], Any]:
    """Build a server from the newest valid checkpoint (or fresh): ``build(states or None)``.

    The files' checksums are verified (chunks on every core) while ``build`` runs (hashing releases
    the GIL, and the mmap-loaded files are read only as they are touched); a checkpoint that fails
    verification is discarded and the next older one tried, with a log line. A checkpoint named by
    ``resume_from`` that fails is an error: the user asked for that one.
    """
    if resume_from:
        candidates = [store.resolve(resume_from, verify=False)]   # verified below, with the build
    elif resume:
        candidates = store.list()
    else:
        return None, build(None)
    for info in candidates:
        names = _shard_files(info, model, shard, num_ps)
        with ThreadPoolExecutor(max_workers=1) as check:
            verified = check.submit(store.verify, info, names)
            built, failure = None, None
            try:
                built = build([store.load_file(info, n) for n in names])
            except Exception as exc:  # noqa: BLE001 - a corrupt file may fail to load; verification decides
                failure = exc
            try:
                verified.result()
            except CheckpointError as exc:
                if built is not None and hasattr(built, "close"):
                    built.close()
                if resume_from:
                    raise
                log.warning("skipping %s: %s", info.id, exc)
                continue
        if failure is not None:
            raise failure
        log.info("resuming from %s (step %d)", info.id, info.step)
        return info, built
    log.info("no valid checkpoint in %s; starting fresh", store.root)
    return None, build(None)


def _shard_files(info: CheckpointInfo, model: dict[str, Any], shard: int, num_ps: int) -> list[str]:
    saved = info.meta.get("model", {})
    for key in ("ntoken", "emsize", "nhid", "nlayers", "optimizer"):
        if saved.get(key) != model.get(key):
            raise CheckpointError(f"{info.id} was taken with {key}={saved.get(key)!r}, this server has "
                                  f"{model.get(key)!r}; start with matching flags, --resume-from another, or --no-resume")
    old = int(info.meta.get("num_ps", 0))
    if old == num_ps:
        return [f"ps{shard}.pt"]  # same shape: this shard's own file is all it needs
    names = [f"ps{k}.pt" for k in range(old)]
    missing = [n for n in names if n not in info.files]
    if missing:
        raise CheckpointError(
            f"{info.id} was taken with {old} servers, each keeping its shard on its own volume "
            f"({', '.join(missing)} are not in {info.path}); changing to {num_ps} servers needs every shard: "
            f"restart with {old} servers, or use one checkpoint folder shared by all servers")
    log.info("resharding %s from %d to %d servers", info.id, old, num_ps)
    return names


def take_final(take: Callable[[], dict], seconds: float) -> None:
    """A checkpoint on the way out, given at most ``seconds``: a stop must stay bounded, and an
    unfinished write leaves the previous checkpoint the newest valid one."""
    done = threading.Event()

    def run() -> None:
        try:
            result = take()
            log.info("final checkpoint %s%s", result["id"], "" if result.get("new", True) else " (already saved)")
        except Exception as exc:  # noqa: BLE001 - the previous checkpoint stays the valid one
            log.warning("final checkpoint failed: %s", exc)
        finally:
            done.set()

    threading.Thread(target=run, name="final-checkpoint", daemon=True).start()
    if not done.wait(seconds):
        log.warning("final checkpoint still running after %.0fs; leaving it unfinished "
                    "(the previous checkpoint stays the newest valid one)", seconds)


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
