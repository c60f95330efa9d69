"""A per-shard index from raw 64-bit ids to rows, built from tensors.

At tens of millions of ids a Python dict costs gigabytes (about 100 bytes an id); this costs 17
bytes a row: open addressing with linear probing over ``2 * capacity`` int32 slots (8 bytes a
row), each empty, a tombstone or a row; each row's id (8 bytes); whether it is live (1 byte).

The probing loops are compiled (numba) and run over a whole batch of ids in one call: a lookup
costs two memory reads an id (its slot, then its row's id), where the same loops written as
tensor operations cost a dozen passes over the batch per probe round. They compile at their
first call (about a second), not from an on-disk cache: an image's package directory may be
read-only.

Rows are handed out lowest first and handed back by ``remove``; a removed id's slot becomes a
tombstone, which lookups step over and inserts reuse. When tombstones fill a quarter of the
slots, the slots are rebuilt from the live rows.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

EMPTY, TOMBSTONE = -1, -2
_NO_SEEN, _NO_HITS = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int16)   # ``find`` marks nothing


@numba.njit(nogil=True)
def _home(key, num_slots):
    mixed = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)     # 2**64 / golden ratio: a multiplicative hash
    mixed ^= mixed >> np.uint64(29)
    return np.int64(mixed % np.uint64(num_slots))


@numba.njit(nogil=True)
def _find(slots, keys, wanted, out, last_seen, hits, step, hits_max, mark):
    """Each wanted id's row (-1: none); with ``mark``, each found row seen at ``step``, once more.

    In passes over the batch, not id by id: each pass's memory reads are independent of one
    another, so the processor has many in flight at once (an id's home slot, then the id its row
    holds, then the marks), where probing id by id waits for one cache miss after another. Only
    the ids not at their home slot are probed further."""
    n = slots.shape[0]
    home = np.empty(wanted.shape[0], dtype=np.int64)
    for i in range(wanted.shape[0]):
        home[i] = _home(wanted[i], n)
    for i in range(wanted.shape[0]):
        out[i] = slots[home[i]]
    for i in range(wanted.shape[0]):
        row = out[i]
        if row >= 0 and keys[row] == wanted[i]:
            continue
        out[i] = -1
        p = home[i]
        while True:
            row = slots[p]
            if row == EMPTY:
                break
            if row >= 0 and keys[row] == wanted[i]:
                out[i] = row
                break
            p = p + 1 if p + 1 < n else 0
    if mark:
        for i in range(wanted.shape[0]):
            row = out[i]
            if row >= 0:
                last_seen[row] = step
                if hits[row] < hits_max:
                    hits[row] += 1


@numba.njit(nogil=True)
def _place(slots, new_keys, rows):
    """Slots for ids that have none; the number of tombstones reused."""
    n = slots.shape[0]
    reused = 0
    for i in range(new_keys.shape[0]):
        p = _home(new_keys[i], n)
        while slots[p] >= 0:
            p = p + 1 if p + 1 < n else 0
        if slots[p] == TOMBSTONE:
            reused += 1
        slots[p] = rows[i]
    return reused


@numba.njit(nogil=True)
def _unplace(slots, keys, rows):
    """Tombstones for ``rows``' slots; how many of them had none (0 unless a row was not live)."""
    n = slots.shape[0]
    missing = 0
    for i in range(rows.shape[0]):
        p = _home(keys[rows[i]], n)
        while slots[p] != rows[i] and slots[p] != EMPTY:
            p = p + 1 if p + 1 < n else 0
        if slots[p] == rows[i]:
            slots[p] = TOMBSTONE
        else:
            missing += 1
    return missing


class HashIndex:
    def __init__(self, capacity: int) -> None:
        if not 1 <= capacity < 2**31:
            raise ValueError(f"capacity must be 1 to 2**31 - 1 rows, got {capacity}")
        self.capacity = capacity
        self.slots = torch.full((2 * capacity,), EMPTY, dtype=torch.int32)
        self.keys = torch.zeros(capacity, dtype=torch.int64)        # each live row's id
        self.live = torch.zeros(capacity, dtype=torch.bool)
        self._used = 0              # live rows
        self._high = 0              # rows below this have been handed out before
        self._holes = torch.empty(0, dtype=torch.int64)    # the free rows below it, in order
        self._tombstones = 0

    def __len__(self) -> int:
        return self._used

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.slots, self.keys, self.live))

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """The row of each id in ``keys`` [n] (int64), -1 where it has none."""
        keys = keys.contiguous()
        out = torch.empty_like(keys)
        _find(self.slots.numpy(), self.keys.numpy(), keys.numpy(), out.numpy(), _NO_SEEN, _NO_HITS, 0, 0, False)
        return out

    def find_marking(self, keys: torch.Tensor, last_seen: torch.Tensor, hits: torch.Tensor, step: int,
                     hits_max: int) -> torch.Tensor:
        """``find``, and in the same pass, for each id found: ``last_seen[row] = step`` and one more
        of ``hits[row]`` (up to ``hits_max``): a hashed table's bookkeeping of every lookup."""
        keys = keys.contiguous()
        out = torch.empty_like(keys)
        _find(self.slots.numpy(), self.keys.numpy(), keys.numpy(), out.numpy(), last_seen.numpy(), hits.numpy(), step,
              hits_max, True)
        return out

    def insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows for ``keys`` [n], distinct ids none of which has a row (the caller checked with
        ``find``), the lowest free rows in order; ``RuntimeError`` if fewer than n are free."""
        n = keys.numel()
        if n > self.capacity - self._used:
            raise RuntimeError(f"{n} new rows asked, {self.capacity - self._used} free of {self.capacity}")
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        reused, self._holes = self._holes[:n], self._holes[n:]
        fresh = n - reused.numel()
        rows = torch.cat([reused, torch.arange(self._high, self._high + fresh)])
        self._high += fresh
        self.keys[rows] = keys
        self.live[rows] = True
        self._used += n
        self._tombstones -= _place(self.slots.numpy(), keys.contiguous().numpy(), rows.to(torch.int32).numpy())
        return rows

    def remove(self, rows: torch.Tensor) -> None:
        """Give back ``rows`` [n] (live, distinct): their ids have no row any more."""
        if rows.numel() == 0:
            return
        if not bool(self.live[rows].all()):
            raise ValueError("remove names rows that are not live")
        _unplace(self.slots.numpy(), self.keys.numpy(), rows.to(torch.int32).contiguous().numpy())
        self.live[rows] = False
        self._holes = torch.cat([self._holes, rows]).sort().values
        self._used -= rows.numel()
        self._tombstones += rows.numel()
        if self._tombstones > self.slots.numel() // 4:
            self.rebuild()

    def rebuild(self) -> None:
        """The slots again from the live rows, without tombstones."""
        self.slots.fill_(EMPTY)
        self._tombstones = 0
        ids, rows = self.rows()
        _place(self.slots.numpy(), ids.numpy(), rows.to(torch.int32).numpy())

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every live row, by row."""
        live = self.live.nonzero().squeeze(1)
        return self.keys[live], live
