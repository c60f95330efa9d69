"""What a process offers cluster checkpoints: parts of its state, in torch's ``state_dict`` manner.

A part is named by its file in a checkpoint (``{name}.pt``). Two kinds take part differently:

* ``SnapshotPart``: big state, copied at the checkpoint's instant and written by its own process
  into its own checkpoint folder (a server's shard, the RL agent's learner). Its state fixes the
  checkpoint's step. ``prepare`` runs before anything is held, to allocate what the copy goes into.
* ``PausedPart``: small state of a loop that is held at a step boundary while the snapshots are
  taken (a trainer's position in its data); its state travels to the coordinator, which writes it.

How they are driven, and where the files go, is ``member.py``'s and ``coordinator.py``'s alone.
``restore_newest`` is the one walk back through a folder's checkpoints to the newest valid one.
"""
from __future__ import annotations

import abc
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from services.checkpoint.store import CheckpointInfo, CheckpointStore
from services.errors import CheckpointError

log = logging.getLogger(__name__)

T = TypeVar("T")


class Part(abc.ABC):
    name: str

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This part's state: private copies, taken at one instant."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a state that ``state_dict`` gave. A part rebuilt from several files (a server's
        shard, resharded from every old shard's) is built from them instead of offering this."""
        raise NotImplementedError(f"{type(self).__name__} is restored as it is built")


class SnapshotPart(Part):
    def prepare(self) -> None:
        """Before the trainers are held: allocate (and touch) what ``state_dict`` copies into."""

    def snapshot(self, base: Optional[int]) -> dict[str, Any]:
        """This part's state for a checkpoint: whole, or (a part that can) only what changed since
        the checkpoint at step ``base``, when it saved in that one (``base_of`` says which it gave)."""
        return self.state_dict()

    def base_of(self, state: dict[str, Any]) -> Optional[int]:
        """The step of the checkpoint ``state`` is a delta against; None for a whole state."""
        return None

    def settle(self, committed: bool, step: int) -> None:
        """The checkpoint of its last snapshot, at ``step``, was committed, or not."""

    @abc.abstractmethod
    def step(self, state: dict[str, Any]) -> int:
        """The step ``state`` is at: the checkpoint's step is the furthest of its snapshots'."""

    def describe(self, state: dict[str, Any]) -> dict[str, Any]:
        """What the manifest's ``meta`` should say of ``state`` besides the coordinator's own."""
        return {}

    def check(self, state: dict[str, Any]) -> None:
        """``CheckpointError`` if ``state`` must not be saved. It runs once the trainers go on again,
        before any file of the checkpoint is written."""


class PausedPart(Part):
    @abc.abstractmethod
    def pause(self, timeout: float) -> None:
        """Hold at the next step boundary, or ``CheckpointError`` after ``timeout`` (and no hold)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Go on."""


def restore_newest(store: CheckpointStore, resume: bool, resume_from: Optional[str],
                   files: Callable[[CheckpointInfo], list[str]],
                   build: Callable[[Optional[list[dict[str, Any]]]], T],
                   merge: Optional[Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = None
                   ) -> tuple[Optional[CheckpointInfo], T]:
    """``build`` from the newest valid checkpoint in ``store`` (or fresh: ``build(None)``).

    ``files(info)`` names the files to build from (or raises ``CheckpointError``: that checkpoint
    can never serve, which is fatal); ``build`` gets them loaded, in that order. Their checksums are
    verified (chunks on every core) while ``build`` runs: hashing releases the GIL, and the
    mmap-loaded files are read only as they are touched. A checkpoint that fails verification is
    skipped, with a log line, for the next older one. One named by ``resume_from`` that fails is an
    error: the user asked for that one. A file that is a delta is rebuilt from the checkpoints it
    chains back to (``CheckpointStore.chain``), each applied with ``merge(older, delta)``.
    """
    if resume_from:
        candidates = [store.resolve(resume_from, verify=False)]   # verified below, with the build
    elif resume:
        candidates = store.list()
    else:
        return None, build(None)
    for info in candidates:
        names = files(info)
        try:
            chains = {n: store.chain(info, n) for n in names}
        except CheckpointError as exc:
            if resume_from:
                raise
            log.warning("skipping %s: %s", info.id, exc)
            continue
        with ThreadPoolExecutor(max_workers=1) as check:
            files_of: dict[str, tuple[CheckpointInfo, list[str]]] = {}
            for n in names:
                for c in chains[n]:
                    files_of.setdefault(c.id, (c, []))[1].append(n)
            # Each checkpoint once, all its files at a time: their chunks are hashed on every core.
            verified = check.submit(lambda: [store.verify(c, files) for c, files in files_of.values()])
            built, failure = None, None
            try:
                built = build([_rebuilt(store, chains[n], n, merge) for n in names])
            except Exception as exc:  # noqa: BLE001 - a corrupt file may fail to load; verification decides
                failure = exc
            try:
                verified.result()
            except CheckpointError as exc:
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


def _rebuilt(store: CheckpointStore, chain: list[CheckpointInfo], name: str,
             merge: Optional[Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]]) -> Any:
    """File ``name`` as of the last of ``chain``: the whole one, each delta applied in order."""
    state = store.load_file(chain[0], name)
    if len(chain) > 1 and merge is None:
        raise CheckpointError(f"{chain[-1].id}: {name} is a delta, and this part cannot apply one")
    for info in chain[1:]:
        state = merge(state, store.load_file(info, name))
    return state
