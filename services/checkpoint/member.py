"""One process's side of cluster checkpoints: its parts (``parts.py``), driven by the coordinator.

Every process serves a ``CheckpointMember``; the leader's coordinator calls its own directly. The
member copies its snapshot parts when told, holds its paused parts while the others copy, and
writes its copies into its own checkpoint folder: into the leader's step folder when the two share
it (the leader's marker is there), otherwise under a manifest of its own (a volume per server),
which the coordinator then records in the cluster's manifest.
"""
from __future__ import annotations

import shutil
import threading
from typing import Any, Optional

from services.checkpoint.parts import Part, PausedPart, SnapshotPart
from services.checkpoint.store import CheckpointStore, FileEntry
from services.remote import Service, remote

OWN_MANIFEST_KEY = "server"   # in a part's own manifest and the leader's ``elsewhere``: who wrote it


def marker(checkpoint_id: str) -> str:
    """The file the leader leaves in a step's folder while it is written: a member that sees it shares the folder."""
    return f".taking-{checkpoint_id}"


class CheckpointMember(Service):
    def __init__(self, name: str, store: CheckpointStore) -> None:
        self.name, self.store = name, store
        self._parts: list[Part] = []
        self._lock = threading.Lock()
        self._copies: dict[str, dict[str, dict[str, Any]]] = {}   # checkpoint id -> part name -> state
        self._written: dict[str, int] = {}                         # checkpoint id -> step, under an own manifest
        self._steps: dict[str, int] = {}                           # checkpoint id -> its step, once written

    def add(self, part: Part) -> None:
        with self._lock:
            self._parts.append(part)

    def _of(self, kind: type) -> list[Any]:
        with self._lock:
            return [p for p in self._parts if isinstance(p, kind)]

    @remote
    def prepare(self, checkpoint_id: str) -> None:
        for part in self._of(SnapshotPart):
            part.prepare()

    @remote
    def pause(self, checkpoint_id: str, timeout: float) -> dict[str, dict]:
        """Hold every paused part at its step boundary; their states (by part name)."""
        held: list[PausedPart] = []
        try:
            for part in self._of(PausedPart):
                part.pause(timeout)
                held.append(part)
            return {part.name: part.state_dict() for part in held}
        except BaseException:
            for part in held:
                part.resume()
            raise

    @remote
    def resume(self, checkpoint_id: str) -> None:
        for part in self._of(PausedPart):
            part.resume()

    @remote
    def snapshot(self, checkpoint_id: str, base: Optional[int] = None) -> dict[str, Any]:
        """Copy every snapshot part now (only what changed since the checkpoint at step ``base``,
        where a part can); ``{"step": the furthest of theirs, "meta": what they say, "bases": the
        step each file that is a delta is one against}``."""
        copies, step, meta, bases = {}, 0, {}, {}
        for part in self._of(SnapshotPart):
            state = copies[part.name] = part.snapshot(base)
            step = max(step, part.step(state))
            meta.update(part.describe(state))
            if part.base_of(state) is not None:
                bases[f"{part.name}.pt"] = part.base_of(state)
        with self._lock:
            self._copies[checkpoint_id] = copies
        return {"step": step, "meta": meta, "bases": bases}

    @remote
    def write(self, checkpoint_id: str, step: int, meta: dict) -> list[tuple[FileEntry, bool]]:
        """Write the copies; with each file, True when it went into the leader's folder."""
        with self._lock:
            copies = self._copies.get(checkpoint_id, {})
            self._steps[checkpoint_id] = step
        for part in self._of(SnapshotPart):
            if part.name in copies:
                part.check(copies[part.name])
        if (self.store.folder(step) / marker(checkpoint_id)).exists():
            return [(self.store.write_file(step, f"{name}.pt", state), True) for name, state in copies.items()]
        # A complete folder of this step here is a part whose cluster checkpoint was never committed.
        self.store.prepare(step, replace=True)
        with self._lock:
            self._written[checkpoint_id] = step
        entries = [self.store.write_file(step, f"{name}.pt", state) for name, state in copies.items()]
        self.store.commit(step, entries, {**meta, OWN_MANIFEST_KEY: self.name})
        return [(entry, False) for entry in entries]

    @remote
    def discard(self, checkpoint_id: str, committed: bool, keep: int) -> None:
        """Drop the copies. What was written under an own manifest is kept (and older ones pruned
        to ``keep``) if the leader ``committed`` the checkpoint, and removed if it did not."""
        with self._lock:
            taken = self._copies.pop(checkpoint_id, None)
            step = self._written.pop(checkpoint_id, None)
            at = self._steps.pop(checkpoint_id, None)
        for part in self._of(SnapshotPart):
            if taken is not None and part.name in taken:   # what its snapshot took is saved, or is not
                part.settle(committed and at is not None, at if at is not None else -1)
        if step is None:
            return
        if committed:
            self.store.prune(keep)
        else:                # the leader never committed it: it is no checkpoint of the cluster's
            shutil.rmtree(self.store.folder(step), ignore_errors=True)
