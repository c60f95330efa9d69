import pytest
import torch

from ps.spec.sharding import Layout
from ps.spec.model import DenseGroup, ModelSpec, Table
from ps.server.state import export_shard, gather_shard
from tests.support.rows import by_id, held, each_storage  # noqa: F401 (autouse: packed and gridded)

NTOKEN, EM, NHID, NLAYERS = 23, 3, 4, 3
ROW_PARAMS = ("embedding.weight", "decoder.weight", "decoder.bias")


def layout(num_shards, ntoken=NTOKEN):
    """The language model's shape: one vocabulary table of three parameters, a dense group per layer."""
    spec = ModelSpec({"vocabulary": Table(ntoken, {n: () for n in ROW_PARAMS}, dict)},
                     tuple(DenseGroup({f"weight_ih_l{layer}": ()}, dict) for layer in range(NLAYERS)), optimizer="adagrad")
    return Layout.of(spec, num_shards)


def full_model():
    g = torch.Generator().manual_seed(0)
    p = {"embedding.weight": torch.randn(NTOKEN, EM, generator=g), "decoder.weight": torch.randn(NTOKEN, NHID, generator=g),
         "decoder.bias": torch.randn(NTOKEN, generator=g)}
    p.update({f"weight_ih_l{layer}": torch.randn(4 * NHID, 2, generator=g) for layer in range(NLAYERS)})
    state = {n: {"sum": torch.rand(t.shape, generator=g), "step": torch.tensor(float(i + 5))} for i, (n, t) in enumerate(p.items())}
    return p, state


def shard_states(num_shards):
    params, optim = full_model()
    lay = layout(num_shards)
    plan = lay.plans["vocabulary"]
    out = []
    for k in range(num_shards):
        rows = plan.global_ids(k)
        sp = {n: by_id(params[n], rows) for n in ROW_PARAMS}
        so = {n: {"sum": by_id(optim[n]["sum"], rows), "step": optim[n]["step"]} for n in ROW_PARAMS}
        for name in lay.dense_of(k):
            sp[name] = params[name]
            so[name] = optim[name]
        out.append(export_shard(k, lay, {"ntoken": NTOKEN}, 42, sp, so))
    return out


@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (1, 2), (2, 2), (3, 5)])
def test_resharding_reassembles_exactly_the_saved_model(old, new):
    params, optim = full_model()
    states = shard_states(old)
    lay = layout(new)
    plan = lay.plans["vocabulary"]
    seen_dense = set()
    for k in range(new):
        dense = lay.dense_of(k)
        p, o, steps, _, _ = gather_shard(states, lay, k)
        rows = plan.global_ids(k)
        assert steps == 42
        for n in ROW_PARAMS:
            assert torch.equal(p[n], by_id(params[n], rows)) and torch.equal(o[n]["sum"], by_id(optim[n]["sum"], rows))
        for n in dense:
            assert torch.equal(p[n], params[n]) and torch.equal(o[n]["sum"], optim[n]["sum"])
            seen_dense.add(n)
    assert seen_dense == {f"weight_ih_l{layer}" for layer in range(NLAYERS)}


def test_missing_shard_or_other_model_is_refused():
    states = shard_states(3)
    with pytest.raises(ValueError, match="every old shard"):
        gather_shard(states[:2], layout(2), 0)
    with pytest.raises(ValueError, match="vocabulary rows"):
        gather_shard(states, layout(2, NTOKEN + 1), 0)


def test_same_shape_restores_from_the_shards_own_file_alone():
    params, optim = full_model()
    states = shard_states(2)
    plan = layout(2).plans["vocabulary"]
    p, o, steps, _, _ = gather_shard([states[1]], layout(2), 1)
    rows = plan.global_ids(1)
    assert steps == 42 and torch.equal(p["decoder.bias"], by_id(params["decoder.bias"], rows))
    assert torch.equal(o["embedding.weight"]["sum"], by_id(optim["embedding.weight"]["sum"], rows))


def test_row_state_of_any_shape_reshards_and_a_shard_without_state_counts_as_zeros():
    states = shard_states(3)
    for k, state in enumerate(states):          # row-wise: one value a row, as RowWiseAdagrad keeps
        rows = state["params"]["decoder.weight"].size(0)
        state["optim"]["decoder.weight"] = {"sum": torch.full((rows,), float(k + 1))}
    del states[1]["optim"]["decoder.bias"]      # this shard's rows never took a step
    lay = layout(2)
    plan = lay.plans["vocabulary"]
    whole_sum = torch.empty(NTOKEN)
    bias_sum = torch.empty(NTOKEN)
    for k, state in enumerate(states):
        rows, ids = held(layout(3).plans["vocabulary"].global_ids(k))
        whole_sum[ids] = float(k + 1)
        bias_sum[ids] = state["optim"]["decoder.bias"]["sum"][rows] if k != 1 else 0.0
    for shard in range(2):
        _, optim, _, _, _ = gather_shard(states, lay, shard)
        ids = plan.global_ids(shard)
        assert torch.equal(optim["decoder.weight"]["sum"], by_id(whole_sum, ids))
        assert torch.equal(optim["decoder.bias"]["sum"], by_id(bias_sum, ids))


class ColumnScale:
    """A rule of the suite's own whose state is one value a *column*: not moved with the rows."""

    name = "column_scale"
    row_state = ()

    def state_shapes(self, param):
        return {"scale": (param.shape[1],)}

    def step(self, param, grad, state, lr):
        param.add_(grad, alpha=-lr)


def test_the_rule_says_which_state_moves_with_the_rows_whatever_its_shape():
    # A table of as many rows as columns: a per-column state of that length looks per-row by shape
    # alone, and resharding by shape would cut it. The rule says it is not.
    side = 6
    spec = ModelSpec({"t": Table(side, {"t.weight": (side,)}, dict, rule=ColumnScale())}, ())
    scale = torch.arange(float(side))
    states = [export_shard(k, Layout.of(spec, 2), {}, 7, {"t.weight": torch.zeros(3, side)},
                           {"t.weight": {"scale": scale}}) for k in range(2)]
    for k in range(3):
        _, optim, _, _, _ = gather_shard(states, Layout.of(spec, 3), k)
        assert torch.equal(optim["t.weight"]["scale"], scale), k
    assert Layout.of(spec, 3).row_state == {"t.weight": ()}
