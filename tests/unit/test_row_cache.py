"""A trainer's copies of rows (``ps/client/cache.py``), alone: a copy serves the steps up to the
bound after the one that read it and never a later one; 0 serves none; the least recently used
go when it is full; a batch's rows come back in its order with the way back to both halves."""
import torch

from ps.client.cache import HotRows


def rows_of(ids):
    return torch.stack([torch.full((4,), float(i)) for i in ids.tolist()])


def test_a_copy_serves_up_to_the_bound_and_is_read_again_after():
    cache = HotRows(capacity=100, staleness=2)
    ids = torch.tensor([5, 3, 5, 9])
    first = cache.take("t", ids, used_at=1)
    assert first.hit_ids.numel() == 0 and first.miss_ids.tolist() == [3, 5, 9]
    cache.store("t", first.miss_ids, rows_of(first.miss_ids), read_at=1)
    for step in (2, 3):
        taken = cache.take("t", ids, used_at=step)
        assert taken.hit_ids.tolist() == [3, 5, 9] and taken.miss_ids.numel() == 0, step
        assert taken.ages.tolist() == [step - 1] * 3
    stale = cache.take("t", torch.tensor([3, 4]), used_at=4)
    assert stale.hit_ids.numel() == 0 and stale.miss_ids.tolist() == [3, 4], "3 steps old: read again"
    cache.store("t", stale.miss_ids, rows_of(stale.miss_ids) + 0.5, read_at=4)
    again = cache.take("t", torch.tensor([3, 9]), used_at=5)
    assert again.hit_ids.tolist() == [3] and again.hit_rows[0, 0] == 3.5, "the copy read at step 4 replaced it"
    assert again.miss_ids.tolist() == [9], "9's copy, read at step 1, is 4 steps old"


def test_staleness_zero_serves_nothing():
    cache = HotRows(capacity=100, staleness=0)
    cache.store("t", torch.tensor([1, 2]), rows_of(torch.tensor([1, 2])), read_at=1)
    assert cache.rows == 0
    taken = cache.take("t", torch.tensor([1, 2]), used_at=1)
    assert taken.hit_ids.numel() == 0 and taken.miss_ids.tolist() == [1, 2]


def test_the_least_recently_used_go_first_when_it_is_full():
    cache = HotRows(capacity=2, staleness=10)
    cache.store("t", torch.tensor([1, 2]), rows_of(torch.tensor([1, 2])), read_at=1)
    cache.take("t", torch.tensor([1]), used_at=2)             # 1 used since; 2 not
    cache.store("t", torch.tensor([3]), rows_of(torch.tensor([3])), read_at=3)
    assert cache.rows == 2
    taken = cache.take("t", torch.tensor([1, 2, 3]), used_at=4)
    assert taken.hit_ids.tolist() == [1, 3] and taken.miss_ids.tolist() == [2]


def test_a_batch_gets_its_rows_in_its_order_and_gradients_reach_both_halves():
    cache = HotRows(capacity=10, staleness=1)
    cache.store("t", torch.tensor([7]), rows_of(torch.tensor([7])), read_at=1)
    ids = torch.tensor([[7, 2], [2, 7]])
    taken = cache.take("t", ids, used_at=2)
    hits = taken.hit_rows.requires_grad_()
    misses = rows_of(taken.miss_ids).requires_grad_()
    batch = taken.assemble(hits, misses)
    assert batch.shape == (2, 2, 4) and batch[:, :, 0].tolist() == [[7.0, 2.0], [2.0, 7.0]]
    batch.sum().backward()
    assert hits.grad.tolist() == [[2.0] * 4] and misses.grad.tolist() == [[2.0] * 4], "each id twice"
    cache.count("t", taken)
    assert (cache.counts.hits, cache.counts.misses, cache.counts.max_age) == (1, 1, 1)


def test_copies_read_again_stay_when_new_ones_need_room():
    cache = HotRows(capacity=2, staleness=10)
    cache.store("t", torch.tensor([1, 2]), rows_of(torch.tensor([1, 2])), read_at=1)
    cache.store("t", torch.tensor([1, 2, 3]), rows_of(torch.tensor([1, 2, 3])) + 0.5, read_at=2)
    taken = cache.take("t", torch.tensor([1, 2, 3]), used_at=3)
    assert taken.hit_ids.tolist() == [1, 2] and taken.hit_rows[:, 0].tolist() == [1.5, 2.5]
    assert taken.miss_ids.tolist() == [3], "no room for 3 without dropping a copy just read"


def test_bench_cache_reports_what_each_bound_gives_by_ids_and_by_lookups():
    # As a user sizes a cache: `rpcps bench cache`, no servers. A bound of 0 gives nothing; an
    # unbounded cache gives some; a hot id named many times counts once by ids, each time by lookups.
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "supervise.cli", "bench", "cache", "--scale", "0.01", "--steps", "12",
                        "--warmup", "4", "--tables", "1", "--shares", "0.05", "--staleness", "0,inf",
                        "--cache-rows", "200"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (table,) = out["tables"].values()
    rates = table["hit_rate"]["0.05"]
    assert rates["S=0"] == {"ids": 0.0, "lookups": 0.0}, rates
    assert 0 < rates["S=inf"]["ids"] < rates["S=inf"]["lookups"] < 1, rates
    assert 0 < out["all_tables"]["hit_rate"]["ids"] < 1 and out["all_tables"]["take_ms_per_step"] > 0, out


def test_a_share_of_each_table_or_the_rows_whichever_is_more():
    # --cache-share 0.01 --cache-rows 3: a table of 1,000 rows keeps 10 copies, one of 100 keeps 3.
    cache = HotRows(capacity=3, staleness=5, share=0.01)
    assert cache.capacity_of(1000) == 10 and cache.capacity_of(100) == 3 and cache.capacity_of(150) == 3
    ids = torch.arange(20)
    cache.store("big", ids, rows_of(ids), read_at=1, table_rows=1000)
    cache.store("small", ids, rows_of(ids), read_at=1, table_rows=100)
    assert cache.take("big", ids, used_at=2).hit_ids.numel() == 10
    assert cache.take("small", ids, used_at=2).hit_ids.numel() == 3
    assert HotRows(capacity=0, staleness=5, share=0.001).capacity_of(999) == 1, "a share rounds up"


def test_hits_are_counted_by_distinct_ids_and_by_lookups():
    # A step naming id 5 three times and 3 once: after 5 alone is kept, one of its two distinct
    # ids hits, three of its four lookups.
    cache = HotRows(capacity=10, staleness=2)
    cache.store("t", torch.tensor([5]), rows_of(torch.tensor([5])), read_at=1)
    taken = cache.take("t", torch.tensor([5, 3, 5, 5]), used_at=2)
    cache.count("t", taken)
    c = cache.counts
    assert (c.hits, c.misses, c.hit_lookups, c.lookups) == (1, 1, 3, 4), c
