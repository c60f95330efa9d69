"""Delta checkpoints of a server's shard, without RPC: a full state and the deltas after it give,
applied in order, exactly what a full snapshot at the last delta's step holds (plain tables bit
for bit; hashed tables by id, evictions included), restored on any server count; a delta whose
checkpoint was never committed leaves its changes to the next one."""
import functools

import pytest
import torch

from ps.server.delta import apply_delta
from ps.spec.model import DenseGroup, Lifecycle, ModelSpec, Table
from ps.spec.sharding import NO_ID
from tests.unit.test_hashed_server import by_id, servers, spec, step
from tests.support.rows import each_storage  # noqa: F401 (autouse: packed and gridded)

DIM = 4


def settle(group, committed=True):
    for s in group:
        with s.optimizer.lock:
            s.params.touched.settle(committed, s.optimizer.steps)


def deltas(group):
    out = [s.export_state(since=s.params.touched.since) for s in group]
    assert all("delta" in d for d in out), "each server had saved in the previous checkpoint"
    return out


def replay(chain):
    return [functools.reduce(apply_delta, [c[k] for c in chain]) for k in range(len(chain[0]))]


def same_by_id(a, b):
    assert a.keys() == b.keys()
    for i in a:
        assert torch.equal(a[i][0], b[i][0]) and a[i][1:] == b[i][1:], i


def test_hashed_full_and_deltas_restore_as_a_full_would_evictions_included():
    model = spec(12, Lifecycle(evict_after_steps=3))      # 6 rows a server: ids come and go
    group = servers(2, model)
    gen = torch.Generator().manual_seed(0)
    chain = []
    for round in range(5):
        for _ in range(3):
            step(group, torch.randint(-40, 40, (7,), generator=gen).unique() * 2**40 + 3, round + 1)
        for s in group:       # a read without an update (its trainer died) changes when rows were seen
            s.hashed.lookup("t", "e.weight", torch.tensor([14 + s.shard]), s.optimizer.steps + 1)
        chain.append([s.export_state() for s in group] if round == 0 else deltas(group))
        if round == 2:        # this checkpoint fails: what it took goes into the next delta
            chain.pop()
            settle(group, committed=False)
        else:
            settle(group)
    assert sum(s.hashed.tables["t"].counts.evicted for s in group) > 0, "the test must evict"
    assert sum(d["hashed"]["t"]["gone"].numel() for d in chain[-1] + chain[-2]) > 0, "tombstones"
    whole = [s.export_state() for s in group]            # at the same step: expiry already ran
    replayed = replay(chain)
    for num in (2, 1, 3):
        same_by_id(by_id(servers(num, model, restore=replayed)), by_id(servers(num, model, restore=whole)))


def plain_spec():
    def init(ids):
        return {"e.weight": ids.float()[:, None] / 10 + torch.arange(DIM), "b": ids.float() / 3}
    return ModelSpec({"t": Table(30, {"e.weight": (DIM,), "b": ()}, init, rule="rowwise_adagrad")},
                     (DenseGroup({"w": (3,)}, lambda: {"w": torch.ones(3)}),), optimizer="adagrad", lr=0.3)


@pytest.mark.parametrize("first_step_after_the_full", [False, True])
def test_plain_full_and_deltas_are_a_full_bit_for_bit(first_step_after_the_full):
    group = servers(2, plain_spec())
    gen = torch.Generator().manual_seed(1)

    def train():
        for s in group:
            ids = s.layout.plans["t"].global_ids(s.shard)
            mine = (ids != NO_ID).nonzero().squeeze(1)     # rows of no id take no updates
            rows = mine[torch.randint(0, mine.numel(), (4,), generator=gen)]
            weight, bias, w = s.param("e.weight"), s.param("b"), s.params.dense.get("w")
            grads = {weight: torch.sparse_coo_tensor(rows[None], torch.randn(4, DIM, generator=gen), weight.shape),
                     bias: torch.sparse_coo_tensor(rows[None], torch.randn(4, generator=gen), bias.shape)}
            if w is not None:
                grads[w] = torch.randn(3, generator=gen)
            s.optimizer.apply(grads)
    if not first_step_after_the_full:
        train()
    chain = [[s.export_state() for s in group]]    # with no optimizer state yet, or some
    settle(group)
    for _ in range(3):
        train()
        chain.append(deltas(group))
        settle(group)
    assert chain[-1][0]["params"]["e.weight"].shape[0] < group[0].param("e.weight").shape[0], "a delta is smaller"
    whole = [s.export_state() for s in group]
    for mine, full in zip(replay(chain), whole):
        assert mine["steps"] == full["steps"] and mine["tables"].keys() == full["tables"].keys()
        for t in full["tables"]:
            assert torch.equal(mine["tables"][t], full["tables"][t])
        for n, value in full["params"].items():
            assert torch.equal(mine["params"][n], value), n
        assert mine["optim"].keys() == full["optim"].keys()
        for n, state in full["optim"].items():
            for k, v in state.items():
                assert torch.equal(mine["optim"][n][k], v), (n, k)


def test_a_server_that_did_not_save_in_the_base_gives_a_full_state():
    (s,) = servers(1, plain_spec())
    assert "delta" not in s.export_state(since=0), "never saved: no base to be a delta of"
    settle([s])
    assert "delta" not in s.export_state(since=s.params.touched.since + 1), "another base"
    assert "delta" in s.export_state(since=s.params.touched.since)


def test_a_delta_carries_the_counts_of_ids_seen_since_its_base():
    from tests.unit.test_live_relayout import sighted
    model = spec(40_000, Lifecycle(admit_after=3))
    group = servers(2, model)
    ids = torch.arange(0, 300) * 5 + 1
    chain = [[s.export_state() for s in group]]
    settle(group)
    early = sighted(group, ids) + sighted(group, ids)      # seen twice after the full checkpoint
    assert len(early) < 5, early
    chain.append(deltas(group))
    for num in (2, 3):
        assert sighted(servers(num, model, restore=replay(chain)), ids) == sorted(ids.tolist()), num
