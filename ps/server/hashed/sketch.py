"""How often a shard has seen ids that have no row yet, in bounded memory: a count-min sketch.

``depth`` rows of ``width`` one-byte counters; an id adds one to a counter in each row, and its
count is the least of them. The count is never below the truth (collisions only add), so an id
seen K times is always admitted at its K-th sighting; a few may be admitted early. Counters stop
at 255, more than any admission threshold needs. ``halve`` ages every count, so that ids seen long
ago do not stay half-admitted for ever.

Sketches of one width add up (``added``): a server that takes slots from another takes its
counts too, so an id half-admitted there is still counted where it lives now. What the other
counted of ids that stay behind only adds to collisions: the count is still never below the truth.
"""
from __future__ import annotations

from typing import Optional

import torch

SKETCH = "sketch"        # a hashed table's counters in a shard state (``HashedTables.snapshot``)

_SEEDS = (-7046029254386353131, -4658895280553007687, 7640891576956012809, -3372029247567499371)


class CountMinSketch:
    def __init__(self, width: int, depth: int = 4) -> None:
        if width < 1 or not 1 <= depth <= len(_SEEDS):
            raise ValueError(f"a sketch needs width >= 1 and depth 1..{len(_SEEDS)}, got {width} x {depth}")
        self.width, self.depth = width, depth
        self.counts = torch.zeros(depth, width, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.counts.numel()

    def _columns(self, ids: torch.Tensor) -> torch.Tensor:
        """[depth, n] each id's counter in each row."""
        mixed = ids[None, :] * torch.tensor(_SEEDS[:self.depth])[:, None]     # wraps around
        return (mixed ^ (mixed >> 31)).remainder(self.width)

    def add(self, ids: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
        """Count distinct ``ids`` [n] seen ``times`` [n] more times each; their counts after."""
        columns = self._columns(ids)
        for d in range(self.depth):
            # Two ids may share a counter: sum per counter, then cap at 255.
            touched, which = columns[d].unique(return_inverse=True)
            added = torch.zeros(touched.numel(), dtype=torch.int32).index_add_(0, which, times.to(torch.int32))
            row = self.counts[d]
            row[touched] = (row[touched].to(torch.int32) + added).clamp_(max=255).to(torch.uint8)
        return self.count(ids)

    def count(self, ids: torch.Tensor) -> torch.Tensor:
        columns = self._columns(ids)
        return torch.stack([self.counts[d][columns[d]] for d in range(self.depth)]).amin(dim=0).to(torch.int64)

    def forget(self, ids: torch.Tensor) -> None:
        """Take distinct ``ids``' counts back out (at admission: an id evicted later comes back
        counted from nothing). Each of its counters loses the id's count; another id sharing one
        may lose what that count over-estimated, which a sketch several times wider than the ids
        it counts keeps rare."""
        columns = self._columns(ids)
        counted = self.count(ids).to(torch.int32)
        for d in range(self.depth):
            touched, which = columns[d].unique(return_inverse=True)
            taken = torch.zeros(touched.numel(), dtype=torch.int32).index_add_(0, which, counted)
            row = self.counts[d]
            row[touched] = (row[touched].to(torch.int32) - taken).clamp_(min=0).to(torch.uint8)

    def halve(self) -> None:
        self.counts.bitwise_right_shift_(1)


def added(counters: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """Sketches' counters of one shape added up, capped at 255; None if there
    are none, or if their shapes differ (sketches of older servers: their ids are counted afresh)."""
    if not counters or any(c.shape != counters[0].shape for c in counters):
        return None
    return torch.stack([c.to(torch.int32) for c in counters]).sum(dim=0).clamp_(max=255).to(torch.uint8)
