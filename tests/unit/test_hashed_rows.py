"""A hashed table's rows on one shard (admission, eviction, capacity) against a plain-Python
model of the same rules, on random streams of raw ids."""
import random
from collections import Counter

import pytest
import torch

from ps.server.hashed.rows import HITS_MAX, HashedRows
from ps.spec.model import Lifecycle
from ps.server.hashed.sketch import CountMinSketch


class Model:
    """The rules, one id at a time, in dicts."""

    def __init__(self, capacity: int, life: Lifecycle):
        self.capacity, self.life = capacity, life
        self.rows: dict[int, int] = {}
        self.last_seen: dict[int, int] = {}
        self.hits: dict[int, int] = {}
        self.pending: Counter = Counter()

    def resolve(self, ids, step):
        life = self.life
        in_use = {self.rows[i] for i in ids if i in self.rows}
        new = []
        for i in ids:
            if i in self.rows:
                continue
            self.pending[i] += 1
            if self.pending[i] >= life.admit_after:
                new.append(i)
        evicted = []
        if len(self.rows) + len(new) > self.capacity:
            evicted = self._evict(step, max(min(int(life.low_water * self.capacity), self.capacity - len(new)), 0),
                                  in_use)
        new = new[:self.capacity - len(self.rows)]
        taken = set(self.rows.values())
        free = [r for r in range(self.capacity) if r not in taken]
        for i, r in zip(new, free):
            self.rows[i] = r
            self.hits[r] = 0
            self.pending[i] = 0
        for i in ids:
            if i in self.rows:
                r = self.rows[i]
                self.last_seen[r] = step
                self.hits[r] = min(self.hits[r] + 1, HITS_MAX)
        return [self.rows.get(i, -1) for i in ids], new, evicted

    def _evict(self, step, target, in_use):
        by_row = sorted((r, i) for i, r in self.rows.items() if r not in in_use)
        ttl = self.life.evict_after_steps
        stale = [(r, i) for r, i in by_row if ttl and step - self.last_seen[r] >= ttl]
        chosen = list(stale)
        more = len(self.rows) - len(stale) - target
        if more > 0:
            rest = [(r, i) for r, i in by_row if (r, i) not in stale]
            rest.sort(key=lambda ri: (self.hits[ri[0]], self.last_seen[ri[0]], ri[0]))
            chosen += rest[:more]
        for r, i in chosen:
            del self.rows[i]
        if chosen and self.life.admit_after > 1:
            self.pending = Counter({i: c // 2 for i, c in self.pending.items()})
        return [i for _, i in chosen]


LIVES = [(64, Lifecycle()), (64, Lifecycle(admit_after=3)), (64, Lifecycle(evict_after_steps=5)),
         (100, Lifecycle(admit_after=2, evict_after_steps=8, low_water=0.5))]


@pytest.mark.parametrize("capacity,life", LIVES, ids=["plain", "admit3", "ttl5", "admit2-ttl8-low0.5"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rows_follow_the_rules_of_the_model(capacity, life, seed):
    rng = random.Random(seed)
    table, model = HashedRows(capacity, life, sketch_width=1 << 16), Model(capacity, life)
    # A skewed stream: a hot few, a warm middle, and raw 64-bit ids seen once.
    for step in range(1, 300):
        ids = list(dict.fromkeys([rng.randrange(8) for _ in range(4)] + [rng.randrange(400) for _ in range(10)]
                                 + [rng.randrange(-2**63, 2**63) for _ in range(3)]))
        got = table.resolve(torch.tensor(ids), step)
        rows, new, evicted = model.resolve(ids, step)
        assert got.rows.tolist() == rows, f"step {step}"
        assert got.fresh_ids.tolist() == new and got.evicted_ids.tolist() == evicted, f"step {step}"
        assert len(table) == len(model.rows) <= capacity
        if life.evict_after_steps and step % 50 == 0:      # as at a checkpoint
            gone = table.expire(step)
            assert gone.tolist() == model._evict(step, capacity, set())
    assert table.counts.admitted > capacity and table.counts.evicted > 0


def test_a_row_in_use_is_never_evicted_and_the_rest_wait():
    table = HashedRows(4)
    table.resolve(torch.tensor([1, 2, 3]), 1)
    got = table.resolve(torch.tensor([1, 2, 3, 10, 11, 12]), 2)
    assert got.rows.tolist()[:3] == [0, 1, 2] and got.evicted_ids.numel() == 0
    assert got.rows.tolist()[3:] == [3, -1, -1], "one row left: the first new id gets it, the others wait"
    assert table.counts.dropped == 2


def test_ids_are_admitted_at_their_kth_request_and_dropped_until_then():
    table = HashedRows(10, Lifecycle(admit_after=3))
    for step in (1, 2):
        assert table.resolve(torch.tensor([7]), step).rows.tolist() == [-1]
    assert table.seen(torch.tensor([7])).tolist() == [2] and table.pending() == 1
    got = table.resolve(torch.tensor([7]), 3)
    assert got.rows.tolist() == [0] and got.fresh_ids.tolist() == [7]
    assert table.counts.dropped == 2 and table.counts.admitted == 1


def test_the_sketch_never_counts_below_the_truth():
    sketch = CountMinSketch(width=64)       # narrow: many collisions
    rng = random.Random(0)
    truth = Counter(rng.randrange(1000) for _ in range(3000))
    ids = torch.tensor(list(truth))
    sketch.add(ids, torch.tensor(list(truth.values())))
    counted = sketch.count(ids).tolist()
    assert all(c >= min(t, 255) for c, t in zip(counted, truth.values()))


def test_bookkeeping_stays_within_its_bytes_per_row():
    assert HashedRows(10_000).nbytes == 23 * 10_000
    assert HashedRows(40_000, Lifecycle(admit_after=2)).nbytes == 24 * 40_000    # the sketch: a byte a row
