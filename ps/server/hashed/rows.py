"""Which rows a hashed table's ids have on one shard: admission, and eviction within a capacity.

A ``HashedRows`` turns a request's raw ids into rows of a fixed ``[capacity, ...]`` parameter:

* an id with a row gets it, and the row is marked seen at this step (and counted, for LFU);
* an id without one is counted in a count-min sketch and admitted once it has been seen in
  ``admit_after`` requests (1: at once); until then it has no row (-1): the caller returns zeros
  for it and drops its gradient;
* when admitting would pass the capacity, rows are evicted first down to the low-water mark:
  rows not seen for ``evict_after_steps`` steps, then the least frequently used (the least recently
  seen among equals); never a row the request itself uses. ``expire`` evicts only the stale ones
  (at a checkpoint).

The caller (the server, under its lock) initialises the values of the rows handed out and clears
their optimizer state; evicted ids are reported so a delta checkpoint can carry their tombstones.
Per row this keeps 6 bytes besides the index's 17: the step it was last seen (int32) and how
often it was seen (int16, stopping at 32,767); with admission, the sketch adds about one more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ps.server.hashed.index import HashIndex
from ps.server.hashed.sketch import CountMinSketch
from ps.spec.model import Lifecycle

HITS_MAX = 32_767


class Resolved(NamedTuple):
    rows: torch.Tensor           # [n] each id's row, -1 where it has none (not admitted yet)
    fresh_rows: torch.Tensor     # rows handed out by this request: to initialise, their state cleared
    fresh_ids: torch.Tensor      # the ids they were handed to
    evicted_ids: torch.Tensor    # ids that lost their rows to make room


@dataclass
class Counts:
    admitted: int = 0            # ids given a row
    evicted: int = 0             # ids that lost theirs
    dropped: int = 0             # lookups of ids without a row (zeros returned, gradient dropped)
    looked_up: int = 0           # ids in training requests
    requests: int = 0            # training requests


def sketch_width(capacity: int) -> int:
    """Counters per sketch row for a table of ``capacity`` rows in all, over every server: the same
    on each of them and under every layout, so that their sketches add up when slots move (an
    eighth of the capacity: on two servers, a quarter of each one's share, a byte per row of it)."""
    return max(1024, capacity // 8)


class HashedRows:
    def __init__(self, capacity: int, life: Lifecycle = Lifecycle(), sketch_width: int = 0) -> None:
        """``capacity``: rows on this shard; ``sketch_width``: counters per sketch row (default: a
        quarter of the capacity, at least 1,024: its 4 rows then cost a byte per table row)."""
        self.capacity, self.life = capacity, life
        self.index = HashIndex(capacity)
        self.last_seen = torch.zeros(capacity, dtype=torch.int32)
        self.hits = torch.zeros(capacity, dtype=torch.int16)
        self.sketch = CountMinSketch(sketch_width or max(1024, capacity // 4)) if life.admit_after > 1 else None
        self.evict_rounds = 0        # eviction rounds so far: a step that read before one may hold stale rows
        self.counts = Counts()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return (self.index.nbytes + self.last_seen.numel() * 4 + self.hits.numel() * 2
                + (self.sketch.nbytes if self.sketch is not None else 0))

    def seen(self, ids: torch.Tensor) -> torch.Tensor:
        """How many requests each of ``ids`` (without a row) has been seen in so far."""
        return self.sketch.count(ids) if self.sketch is not None else torch.zeros_like(ids)

    def resolve(self, ids: torch.Tensor, step: int) -> Resolved:
        """Rows for ``ids`` [n] (int64) at server step ``step``, admitting and evicting as the
        lifecycle says. An id named twice is counted and admitted once."""
        # Known ids are found and marked seen in one compiled pass: the common case, kept cheap.
        rows = self.index.find_marking(ids, self.last_seen, self.hits, step, HITS_MAX)
        missing = (rows < 0).nonzero().squeeze(1)
        fresh_rows = fresh_ids = evicted = torch.empty(0, dtype=torch.int64)
        if missing.numel():
            unknown, where = _in_order_asked(ids[missing])
            admit = torch.ones(unknown.numel(), dtype=torch.bool)
            if self.sketch is not None:
                admit = self.sketch.add(unknown, torch.ones_like(unknown)) >= self.life.admit_after
            new = admit.nonzero().squeeze(1)
            evicted = self._make_room(new.numel(), step, rows[rows >= 0])
            new = new[:self.capacity - len(self.index)]       # more new ids than rows: the rest wait
            if new.numel():
                fresh_ids = unknown[new]
                fresh_rows = self.index.insert(fresh_ids)
                row_of = torch.full((unknown.numel(),), -1, dtype=torch.int64)
                row_of[new] = fresh_rows
                rows[missing] = row_of[where]
                self.last_seen[fresh_rows] = step
                self.hits[fresh_rows] = 1
                if self.sketch is not None:
                    self.sketch.forget(fresh_ids)
                self.counts.admitted += new.numel()
        self.counts.dropped += int((rows < 0).sum()) if missing.numel() else 0
        self.counts.looked_up += ids.numel()
        self.counts.requests += 1
        return Resolved(rows, fresh_rows, fresh_ids, evicted)

    def pending(self) -> int:
        """About how many ids have been seen but not admitted: the sketch's first row's counters
        in use (never more than its width)."""
        return int(self.sketch.counts[0].count_nonzero()) if self.sketch is not None else 0

    def peek(self, ids: torch.Tensor) -> Resolved:
        """The rows ``ids`` have, changing nothing (an evaluation's read)."""
        nothing = torch.empty(0, dtype=torch.int64)
        return Resolved(self.index.find(ids), nothing, nothing, nothing)

    def expire(self, step: int) -> torch.Tensor:
        """Evict the rows not seen for ``evict_after_steps`` steps (none when it is 0); their ids."""
        if not self.life.evict_after_steps:
            return torch.empty(0, dtype=torch.int64)
        return self._evict(step, self.capacity, torch.empty(0, dtype=torch.int64))

    def _make_room(self, new: int, step: int, in_use: torch.Tensor) -> torch.Tensor:
        if len(self.index) + new <= self.capacity:
            return torch.empty(0, dtype=torch.int64)
        target = min(int(self.life.low_water * self.capacity), self.capacity - new)
        return self._evict(step, max(target, 0), in_use)

    def _evict(self, step: int, target: int, in_use: torch.Tensor) -> torch.Tensor:
        """Evict stale rows, then the least used, until at most ``target`` rows are left; never
        ``in_use``. The ids evicted."""
        _, rows = self.index.rows()
        keep = torch.ones(self.capacity, dtype=torch.bool)
        keep[in_use] = False
        candidates = rows[keep[rows]]
        ttl = self.life.evict_after_steps
        stale = (step - self.last_seen[candidates].to(torch.int64) >= ttl) if ttl else \
            torch.zeros(candidates.numel(), dtype=torch.bool)
        chosen = candidates[stale]
        rest = candidates[~stale]
        more = min(len(self.index) - chosen.numel() - target, rest.numel())
        if more > 0:
            # Least used first; among equals the longest unseen, then the lowest row. The ``more``
            # smallest are found in linear time (a k-th value), and only they are sorted.
            order = self.hits[rest].to(torch.int64) * (1 << 32) + self.last_seen[rest].to(torch.int64)
            bar = torch.kthvalue(order, more).values
            below = (order < bar).nonzero().squeeze(1)
            at = (order == bar).nonzero().squeeze(1)[:more - below.numel()]
            picked = torch.cat([below, at]).sort().values          # by row, so equals stay in row order
            picked = picked[torch.sort(order[picked], stable=True).indices]
            chosen = torch.cat([chosen, rest[picked]])
        if chosen.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        gone = self.index.keys[chosen].clone()
        self.index.remove(chosen)
        self.counts.evicted += chosen.numel()
        self.evict_rounds += 1
        if self.sketch is not None:
            self.sketch.halve()     # each eviction round ages what is half-admitted
        return gone


def _in_order_asked(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct ``ids`` in the order first asked, each id's place among them): new rows go to
    new ids in the order a request names them."""
    distinct, where = ids.unique(return_inverse=True)
    first = torch.full((distinct.numel(),), ids.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, where, torch.arange(ids.numel()), reduce="amin")
    order = first.argsort()
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel())
    return distinct[order], place[where]


def warm_up() -> None:
    """Compile the index's loops now, for the types a table uses: a server does this before it
    joins, so no trainer's first steps wait a second or more for the compiler."""
    rows = HashedRows(4, Lifecycle(admit_after=2))
    for step in range(3):
        rows.resolve(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64), step)
    rows.peek(torch.tensor([1], dtype=torch.int64))
    rows.index.remove(rows.index.rows()[1][:1])
    rows.index.rebuild()
