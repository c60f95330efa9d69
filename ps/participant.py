"""A server's part in cluster checkpoints: its shard copied at the coordinator's instant, written
into this server's checkpoint folder, and discarded or kept when the coordinator is done."""
from __future__ import annotations

import shutil
import threading
from typing import Any

from ps.service import ParameterServer
from services.checkpoint import CheckpointStore, FileEntry
from services.checkpointing import ShardParticipant, marker


class ShardPart(ShardParticipant):
    def __init__(self, name: str, server: ParameterServer, store: CheckpointStore, keep: int) -> None:
        self.name, self.server, self.store, self.keep = name, server, store, keep
        self._lock = threading.Lock()
        self._snapshots: dict[str, Any] = {}   # checkpoint id -> buffers, then the copied state
        self._written: dict[str, int] = {}     # checkpoint id -> step, of parts written under an own manifest

    def ckpt_prepare(self, checkpoint_id: str) -> None:
        buffers = self.server.optimizer.copy_buffers()
        with self._lock:
            self._snapshots[checkpoint_id] = buffers

    def ckpt_snapshot(self, checkpoint_id: str) -> int:
        with self._lock:
            buffers = self._snapshots.get(checkpoint_id)
        state = self.server.export_state(into=buffers if isinstance(buffers, tuple) else None)
        with self._lock:
            self._snapshots[checkpoint_id] = state
        return state["steps"]

    def ckpt_write(self, checkpoint_id: str, step: int, meta: dict[str, Any]) -> tuple[FileEntry, bool]:
        """Write this shard into this server's checkpoint folder; True when ps0 shares the folder.
        Otherwise (a volume per server) the shard gets a manifest of its own beside it."""
        with self._lock:
            state = self._snapshots[checkpoint_id]
        file_name = f"{self.name}.pt"
        if (self.store.folder(step) / marker(checkpoint_id)).exists():
            return self.store.write_file(step, file_name, state), True
        # A complete folder of this step here is a part whose cluster checkpoint was never committed.
        self.store.prepare(step, replace=True)
        with self._lock:
            self._written[checkpoint_id] = step
        entry = self.store.write_file(step, file_name, state)
        self.store.commit(step, [entry], {**meta, "server": self.name})
        return entry, False

    def ckpt_discard(self, checkpoint_id: str, committed: bool = False) -> None:
        with self._lock:
            self._snapshots.pop(checkpoint_id, None)
            step = self._written.pop(checkpoint_id, None)
        if step is None:
            return
        if committed:
            self.store.prune(self.keep)
        else:                # ps0 never committed it: it is no checkpoint of the cluster's
            shutil.rmtree(self.store.folder(step), ignore_errors=True)
