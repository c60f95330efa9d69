"""The index from raw 64-bit ids to rows, against a Python dict on random streams."""
import random

import pytest
import torch

from ps.server.hashed.index import HashIndex


def check_against(index: HashIndex, expected: dict[int, int]) -> None:
    ids, rows = index.rows()
    assert dict(zip(ids.tolist(), rows.tolist())) == expected
    assert len(index) == len(expected) <= index.capacity


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_index_answers_as_a_dict_through_inserts_and_removals(seed):
    rng = random.Random(seed)
    index, expected = HashIndex(500), {}
    for _ in range(200):
        # Raw ids from the whole int64 range, and a small range that repeats.
        asked = list({rng.randrange(-2**63, 2**63) if rng.random() < 0.3 else rng.randrange(1500)
                      for _ in range(rng.randrange(1, 60))})
        found = index.find(torch.tensor(asked))
        assert found.tolist() == [expected.get(k, -1) for k in asked]
        new = [k for k, r in zip(asked, found.tolist()) if r < 0]
        if len(expected) + len(new) > index.capacity:
            gone = rng.sample(sorted(expected), min(len(expected), rng.randrange(50, 200)))
            index.remove(torch.tensor([expected[k] for k in gone]))
            for k in gone:
                del expected[k]
            assert (index.find(torch.tensor(gone)) == -1).all()
        free_before = sorted(set(range(index.capacity)) - set(expected.values()))
        rows = index.insert(torch.tensor(new, dtype=torch.int64))
        assert rows.tolist() == free_before[:len(new)], "the lowest free rows, in order"
        expected.update(zip(new, rows.tolist()))
        check_against(index, expected)
    assert index._tombstones <= index.slots.numel() // 4


def test_a_full_index_refuses_more_and_keeps_what_it_has():
    index = HashIndex(4)
    index.insert(torch.tensor([10, 20, 30]))
    with pytest.raises(RuntimeError, match="2 new rows asked, 1 free of 4"):
        index.insert(torch.tensor([40, 50]))
    check_against(index, {10: 0, 20: 1, 30: 2})


def test_a_rebuild_keeps_every_row_and_drops_the_tombstones():
    index = HashIndex(1000)
    rows = index.insert(torch.arange(1000) * 7919)
    index.remove(rows[::3])
    kept = {k: r for k, r in zip((torch.arange(1000) * 7919).tolist(), rows.tolist()) if r % 3}
    index.rebuild()
    assert not (index.slots == -2).any()
    check_against(index, kept)


def test_the_index_costs_seventeen_bytes_a_row():
    assert HashIndex(1000).nbytes == 17 * 1000
