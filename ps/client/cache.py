"""A trainer's copies of the rows it reads most (``--cache-rows N``, ``--cache-staleness S``): a
step takes a row from here instead of the servers while the copy is at most S of this trainer's
steps old: while it misses the updates of at most S of its steps (a copy read in step t, before
its update, serves steps t .. t + S; one read between steps t - 1 and t the same). An older copy is
read again. The gradients of a row taken from here go to the servers with the step's others
(``Copies`` in ``ps/client/fetching.py``), so the servers' rows miss nothing; what the cache costs is
only that a step computes with a row that may miss up to S steps of updates (its own among them).
S = 0 is another kind of cache: rows replicated among the trainers, which step them themselves
(``trainer/core/hot_rows.py``), since a copy kept here would be stale by the next step: every row
a step reads, that step's own update changes.

Per table parameter the copies sit in slots (ids, rows, the step each was read at, the step each
was last used at); a sorted index of the ids finds their slots. When the slots are full, the
least recently used go. No RPC, no threads: the step that owns the client calls it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch


class _Slots:
    """One parameter's copies: ``ids``, ``rows``, ``read_at``, ``used_at`` in slots ``[:size]``
    (grown as needed, up to the capacity), and ``keys`` (their ids, sorted) with ``slot_of``."""

    def __init__(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        self.ids = torch.zeros(n, dtype=torch.long)
        self.rows = rows.new_zeros(rows.shape)
        self.read_at = torch.zeros(n, dtype=torch.long)
        self.used_at = torch.zeros(n, dtype=torch.long)
        self.size = 0
        self.keys = torch.zeros(0, dtype=torch.long)
        self.slot_of = torch.zeros(0, dtype=torch.long)
        self._place = torch.zeros(0, dtype=torch.long)

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of sorted unique ``ids``: the places of those with a copy, and their slots. (Integer
        places, not a mask: a mask would be turned into them again by every tensor it picks from.)"""
        if not self.size:
            return ids[:0], ids[:0]
        at = torch.searchsorted(self.keys, ids).clamp_(max=self.size - 1)
        places = (self.keys[at] == ids).nonzero().squeeze(1)
        return places, self.slot_of[at[places]]

    def room(self, n: int, capacity: int, keep: torch.Tensor) -> torch.Tensor:
        """Slots for ``n`` new copies (at most the free slots and those not in ``keep``): free
        ones, grown into, then the least recently used ones' outside ``keep``."""
        free = min(n, capacity - self.size)
        if self.size + free > self.ids.numel():
            grow = min(capacity, max(2 * self.ids.numel(), self.size + free)) - self.ids.numel()
            self.ids = torch.cat([self.ids, self.ids.new_zeros(grow)])
            self.rows = torch.cat([self.rows, self.rows.new_zeros(grow, *self.rows.shape[1:])])
            self.read_at = torch.cat([self.read_at, self.read_at.new_zeros(grow)])
            self.used_at = torch.cat([self.used_at, self.used_at.new_zeros(grow)])
        slots = torch.arange(self.size, self.size + free)
        if n > free:
            recency = self.used_at[:self.size].clone()
            recency[keep] = torch.iinfo(torch.long).max
            evicted = torch.topk(recency, n - free, largest=False, sorted=False).indices
            slots = torch.cat([slots, evicted])
        self.size += free
        return slots

    def reindex(self, added: torch.Tensor, slots: torch.Tensor, dropped: torch.Tensor) -> None:
        """The index with the copies of slots ``dropped`` gone and ids ``added`` (sorted, none
        indexed yet) in ``slots``: merged in place of a sort, which would cost more than the rest
        of a step's caching."""
        keys, slot_of = self.keys, self.slot_of
        if dropped.numel():
            stay = torch.ones(keys.numel(), dtype=torch.bool)
            stay[self._place[dropped]] = False
            keys, slot_of = keys[stay], slot_of[stay]
        at = torch.searchsorted(keys, added) + torch.arange(added.numel())
        n = keys.numel() + added.numel()
        fresh = torch.zeros(n, dtype=torch.bool)
        fresh[at] = True
        self.keys, self.slot_of = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
        self.keys[at], self.slot_of[at] = added, slots
        self.keys[~fresh], self.slot_of[~fresh] = keys, slot_of
        self._place = torch.empty(self.ids.numel(), dtype=torch.long)     # each slot's place in the index
        self._place[self.slot_of] = torch.arange(n)


@dataclass
class Taken:
    """A parameter's unique ids cut in two: those taken from the cache (``hit_ids``, their rows
    ``hit_rows``) and those to read (``miss_ids``); ``inverse`` and ``shape`` put the batch back."""

    shape: torch.Size
    inverse: torch.Tensor
    hit_places: torch.Tensor     # places among the unique ids
    hit_ids: torch.Tensor
    hit_rows: torch.Tensor
    miss_places: torch.Tensor
    miss_ids: torch.Tensor
    ages: torch.Tensor           # of the copies taken, in steps

    def assemble(self, hits: torch.Tensor, misses: torch.Tensor) -> torch.Tensor:
        """The batch's rows [*shape, *row shape] from the copies (``hits``) and the rows read
        (``misses``, in ``miss_ids``' order), with the way back to both for gradients."""
        order = torch.argsort(torch.cat([self.miss_places, self.hit_places]))
        by_unique = torch.cat([misses, hits.to(misses.dtype)]).index_select(0, order)   # as LookupPlan.collect
        return by_unique.index_select(0, self.inverse).view(*self.shape, *by_unique.shape[1:])


@dataclass
class CacheCounts:
    hits: int = 0                # ids a step took from the cache (each distinct id of a step once)
    misses: int = 0              # ids it read from the servers instead
    saved: int = 0               # bytes of rows not read from the servers, as they would have crossed the wire
    max_age: int = 0             # of the copies taken, in steps
    rows: int = 0                # copies held (set when reported)
    hit_lookups: int = 0         # the hits counted as often as the step's batch names each (as HET counts)
    lookups: int = 0             # every id the steps' batches named, repeats counted

    _ADDED = ("hits", "misses", "saved", "hit_lookups", "lookups")     # what adds up over steps

    def since(self, before: "CacheCounts", rows: int) -> "CacheCounts":
        """What was counted after ``before`` (a copy of these counts), with ``rows`` copies held now."""
        return CacheCounts(**{f: getattr(self, f) - getattr(before, f) for f in self._ADDED},
                           max_age=self.max_age, rows=rows)

    def add(self, step: "CacheCounts") -> None:
        """A step's counts added to these (its oldest copy and the copies held taken as they are)."""
        for f in self._ADDED:
            setattr(self, f, getattr(self, f) + getattr(step, f))
        self.max_age, self.rows = step.max_age, step.rows


@dataclass
class HotRows:
    """Per table parameter at most ``capacity`` rows or ``share`` of its table's, whichever is
    more; each served while ``staleness`` steps old at most."""

    capacity: int
    staleness: int
    share: float = 0.0
    # Whether the copies are replicas the trainers step themselves (``trainer/core/hot_rows.py``).
    replicated: ClassVar[bool] = False
    _tables: dict[str, _Slots] = field(default_factory=dict)
    _row_bytes: dict[str, int] = field(default_factory=dict)
    counts: CacheCounts = field(default_factory=CacheCounts)

    @property
    def rows(self) -> int:
        return sum(t.size for t in self._tables.values())

    def take(self, param: str, ids: torch.Tensor, used_at: int) -> Taken:
        """``ids`` of ``param`` for the step ``used_at``: which copies it may take."""
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        kept = self._tables.get(param)
        if kept is None or self.staleness <= 0:
            none = unique[:0]
            return Taken(ids.shape, inverse, none, none, torch.zeros(0), torch.arange(unique.numel()), unique, none)
        places, slot = kept.locate(unique)
        ages = used_at - kept.read_at[slot]
        fresh = (ages <= self.staleness).nonzero().squeeze(1)
        if fresh.numel() < places.numel():
            places, slot, ages = places[fresh], slot[fresh], ages[fresh]
        kept.used_at[slot] = used_at
        return Taken(ids.shape, inverse, places, unique[places], kept.rows[slot], *others(places, unique), ages)

    def note_row_bytes(self, param: str, size: int) -> None:
        """A row of ``param`` as it crosses the wire (its wire precision's bytes)."""
        if size:
            self._row_bytes[param] = size

    def count(self, param: str, taken: Taken) -> None:
        """``taken`` was used by a step."""
        c = self.counts
        c.hits += taken.hit_ids.numel()
        c.misses += taken.miss_ids.numel()
        c.saved += taken.hit_ids.numel() * self._row_bytes.get(param, 0)
        c.lookups += taken.inverse.numel()
        if taken.hit_places.numel():
            named = torch.bincount(taken.inverse, minlength=taken.hit_places.numel() + taken.miss_places.numel())
            c.hit_lookups += int(named[taken.hit_places].sum())
        if taken.ages.numel():
            c.max_age = max(c.max_age, int(taken.ages.max()))

    def capacity_of(self, table_rows: int) -> int:
        """The copies kept of a table of ``table_rows`` rows."""
        return max(self.capacity, math.ceil(self.share * table_rows))

    def store(self, param: str, ids: torch.Tensor, rows: torch.Tensor, read_at: int, table_rows: int = 0) -> None:
        """Copies of ``rows`` (of unique ``ids`` of a table of ``table_rows`` rows), read at step
        ``read_at``: they replace older copies of the same ids; the least recently used go beyond
        the capacity."""
        capacity = self.capacity_of(table_rows)
        if not ids.numel() or self.staleness <= 0 or capacity <= 0:
            return
        rows = rows.detach()
        kept = self._tables.get(param)
        if kept is None:
            kept = self._tables[param] = _Slots(rows.new_zeros(min(capacity, 2 * ids.numel()), *rows.shape[1:]))
        places, slot = kept.locate(ids)                  # copies replaced: they stay
        new_places, added = others(places, ids)
        if added.numel() > capacity - places.numel():    # more than it holds: the first ones
            new_places, added = new_places[:capacity - places.numel()], added[:capacity - places.numel()]
        size = kept.size
        added_slots = kept.room(added.numel(), capacity, slot)
        dropped = added_slots[added_slots < size]        # slots whose copies went
        if added.numel():
            slot, places = torch.cat([slot, added_slots]), torch.cat([places, new_places])
            kept.ids[added_slots] = added
        kept.rows[slot] = rows[places].to(kept.rows.dtype)
        kept.read_at[slot] = read_at
        kept.used_at[slot] = torch.clamp(kept.used_at[slot], min=read_at)
        if added.numel():
            kept.reindex(added, added_slots, dropped)

    def forget(self) -> None:
        """Drop every copy (the servers' rows may have changed wholesale: a restore)."""
        self._tables.clear()


def others(places: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The places of ``ids`` not among ``places`` (increasing), and those ids."""
    if places.numel() == ids.numel():
        return places[:0], ids[:0]
    rest = torch.ones(ids.numel(), dtype=torch.bool)
    rest[places] = False
    left = rest.nonzero().squeeze(1)
    return left, ids[left]

