"""A server's export -> restore round trip, bit for bit, including resharding (no RPC needed)."""
import pytest
import torch

from tests.support.rows import held, each_storage  # noqa: F401 (autouse: packed and gridded)
from prometheus_client import CollectorRegistry

from ps.server.metrics import PsMetrics
from ps.server.service import ParameterServer
from trainer.lm.config import LmModelConfig
from trainer.lm.model import model_spec

MODEL = LmModelConfig(ntoken=50, emsize=8, nhid=8, nlayers=3, lr=0.1, optimizer="adagrad")


def servers(num, restore=None):
    return [ParameterServer(f"ps{k}", k, num, model_spec(MODEL), PsMetrics(CollectorRegistry(), "ps", f"ps{k}"),
                            restore=restore)
            for k in range(num)]


def train_a_little(server):
    """Apply one update with a known gradient through the server's own optimizer path."""
    g = torch.Generator().manual_seed(server.shard)
    server.optimizer.apply({p: torch.randn(p.shape, generator=g) for p in server.optimizer.params})


def full_view(group):
    out = {}
    for s in group:
        rows, ids = held(s.layout.plans["vocabulary"].global_ids(s.shard))
        for name, p in zip(s.params.names, s.optimizer.params):
            state = s.optimizer.optimizer.state.get(p, {})
            if name in ("embedding.weight", "decoder.weight", "decoder.bias"):
                out.setdefault(name, {})[tuple(ids.tolist())] = (p.detach()[rows].clone(), state["sum"][rows].clone())
            else:
                out[name] = (p.detach().clone(), state["sum"].clone())
    return out


def gather_rows(view, name, ntoken):
    value, acc = None, None
    for rows, (p, s) in view[name].items():
        if value is None:
            value, acc = torch.empty(ntoken, *p.shape[1:]), torch.empty(ntoken, *s.shape[1:])
        value[list(rows)], acc[list(rows)] = p, s
    return value, acc


def test_export_restore_round_trip_and_resharding():
    old = servers(2)
    for s in old:
        train_a_little(s)
    states = [s.export_state() for s in old]
    for new_count in (2, 3, 1):
        new = servers(new_count, restore=states)
        assert all(s.optimizer.steps == 1 for s in new)
        a, b = full_view(old), full_view(new)
        for name in ("embedding.weight", "decoder.weight", "decoder.bias"):
            pa, sa = gather_rows(a, name, MODEL.ntoken)
            pb, sb = gather_rows(b, name, MODEL.ntoken)
            assert torch.equal(pa, pb) and torch.equal(sa, sb), (new_count, name)
        for name in a:
            if name.startswith(("weight_", "bias_")):
                assert torch.equal(a[name][0], b[name][0]) and torch.equal(a[name][1], b[name][1]), name


def test_a_shard_with_values_that_are_not_finite_is_refused_for_a_checkpoint():
    from ps.server.participant import ServerPart
    from services.errors import CheckpointError
    (server,) = servers(1)
    train_a_little(server)
    part = ServerPart("ps0", server)
    part.check(server.export_state())                     # a sound shard passes
    with torch.no_grad():
        server.param("decoder.bias")[3] = float("nan")
    with pytest.raises(CheckpointError, match="decoder.bias"):
        part.check(server.export_state())


def test_each_table_steps_by_its_own_rule_and_its_state_reshards():
    from ps.spec.rules import RowWiseAdagrad, Sgd
    from ps.spec.model import DenseGroup, ModelSpec, Table
    g = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(10, 4, generator=g), "b": torch.randn(7, 4, generator=g), "w": torch.randn(3, generator=g)}
    spec = ModelSpec({"ta": Table(10, {"a": (4,)}, lambda ids: {"a": start["a"][ids]}, rule="rowwise_adagrad"),
                      "tb": Table(7, {"b": (4,)}, lambda ids: {"b": start["b"][ids]})},
                     (DenseGroup({"w": (3,)}, lambda: {"w": start["w"].clone()}),), optimizer=Sgd(), lr=0.5)
    [server] = [ParameterServer("ps0", 0, 1, spec, PsMetrics(CollectorRegistry(), "ps", "ps0"))]
    ids = torch.tensor([1, 4, 4, 9])
    grads = {"a": torch.sparse_coo_tensor(ids[None], torch.ones(4, 4), (10, 4)),
             "b": torch.sparse_coo_tensor(ids[None] % 7, torch.ones(4, 4), (7, 4)), "w": torch.ones(3)}
    # One server's rows are its ids in order (then rows of no id, to its last column's end).
    server.optimizer.apply({server.param(n): server.params.sparse_grad(n, g._indices()[0], g._values())
                            if g.is_sparse else g for n, g in grads.items()})
    expect_a, state = start["a"].clone(), {"sum": torch.zeros(10)}
    RowWiseAdagrad().step(expect_a, grads["a"], state, 0.5)
    assert torch.equal(server.param("a").detach()[:10], expect_a)
    assert torch.equal(server.param("b").detach()[:7], start["b"] - 0.5 * grads["b"].to_dense())
    assert torch.equal(server.param("w").detach(), start["w"] - 0.5)
    saved = server.export_state()
    assert saved["optim"]["a"]["sum"].shape == server.param("a").shape[:1] and "b" not in saved["optim"]    # SGD keeps nothing
    for num in (1, 2):
        again = [ParameterServer(f"ps{k}", k, num, spec, PsMetrics(CollectorRegistry(), "ps", f"ps{k}"),
                                 restore=[saved]) for k in range(num)]
        sums = torch.empty(10)
        for s in again:
            rows, ids = held(s.layout.plans["ta"].global_ids(s.shard))
            sums[ids] = s.optimizer.state_of(s.param("a"))["sum"][rows]
        assert torch.equal(sums, state["sum"])


def servers_under(slots, restore=None):
    return [ParameterServer(name, k, slots, model_spec(MODEL), PsMetrics(CollectorRegistry(), "ps", name),
                            restore=restore) for k, name in enumerate(slots.servers)]


def test_a_change_of_layout_moves_rows_with_their_state_and_back():
    """2 -> 3 -> 2 servers as the difference of layouts: every row, its optimizer state and each
    dense tensor where the new layout puts it, bit for bit; a shard whose layout did not change
    restores from its own state alone."""
    from ps.server.state import gather_shard, same_layout
    from ps.spec.sharding import first_slots
    first = first_slots(model_spec(MODEL), 2)
    old = servers_under(first)
    for s in old:
        train_a_little(s)
    before = full_view(old)
    states = [s.export_state() for s in old]
    assert all(same_layout(st, s.layout) for st, s in zip(states, old))
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    three = servers_under(grown, restore=states)
    assert not same_layout(states[0], three[0].layout) and three[2].layout.epoch == 2
    back = grown.rebalanced(["ps0", "ps1"])
    two = servers_under(back, restore=[s.export_state() for s in three])
    for group in (three, two):
        after = full_view(group)
        for name in ("embedding.weight", "decoder.weight", "decoder.bias"):
            pa, sa = gather_rows(before, name, MODEL.ntoken)
            pb, sb = gather_rows(after, name, MODEL.ntoken)
            assert torch.equal(pa, pb) and torch.equal(sa, sb), name
        for name in before:
            if name.startswith(("weight_", "bias_")):
                assert torch.equal(before[name][0], after[name][0]) and torch.equal(before[name][1], after[name][1])
    own = two[1].export_state()
    params, *_ = gather_shard([own], two[1].layout, 1)
    assert all(params[n] is own["params"][n] for n in ("embedding.weight", "decoder.bias"))   # taken as saved
    with pytest.raises(ValueError, match="need every old shard"):
        gather_shard([own], three[1].layout, 1)
