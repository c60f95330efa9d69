"""A shard's rows of a table, and the reusable buffers big server-side operations compute in."""
from __future__ import annotations

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F


class RowShard(nn.Module):
    """One table parameter's rows on this shard, [rows, *row shape], looked up by local row."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 2:
            # sparse=True: a step's gradient (and update) touches only the rows it used.
            return F.embedding(local_ids, self.weight, sparse=True)
        return self.weight[local_ids]   # rows of another shape: a dense gradient


class BufferPool:
    """Reuses large [tokens, rows] buffers between calls of a server-side operation.

    glibc serves allocations over 32 MB with mmap/munmap, so a fresh 46 MB buffer per call costs
    thousands of page faults and cross-core TLB shootdowns; reuse costs nothing. A buffer whose
    backward never comes (its trainer died) is simply garbage-collected.
    """

    def __init__(self, keep: int = 4) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._keep = keep

    def take(self, rows: int, cols: int) -> torch.Tensor:
        need = rows * cols
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            if fits:
                base = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                return base[:need].view(rows, cols)
        return torch.empty(need).view(rows, cols)

    def give(self, buffer: torch.Tensor) -> None:
        base = buffer._base if buffer._base is not None else buffer
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(base.view(-1))
