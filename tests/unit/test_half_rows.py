"""Half-precision rows: stochastic rounding is unbiased where rounding to nearest is not, a server
stores fp16/bf16 tables and keeps their gradients and optimizer state fp32, sends rows in the
table's wire dtype, and checkpoints them bit for bit (and into a table of another precision)."""
import pytest
import torch
from prometheus_client import CollectorRegistry

from ps.spec.model import Lifecycle, ModelSpec, Table
from ps.server.metrics import PsMetrics
from ps.spec.precision import add_rows, stochastic_round
from ps.server.service import ParameterServer

DIM = 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(dtype):
    torch.manual_seed(0)
    base = torch.tensor([1.0, -3.0, 0.01, 250.0, 3e-6, -2e-7]).to(dtype)     # the last two: fp16's subnormals
    ulp = (torch.nextafter(base, torch.full_like(base, float("inf"))) - base).float()
    # Between two neighbours, nearer the lower.
    x = base.float() + ulp * torch.tensor([0.1, 0.3, 0.45, 0.2, 0.25, 0.15])
    draws = 20_000
    rounded = stochastic_round(x.expand(draws, -1).contiguous(), dtype).float()
    assert set(rounded[:, 0].unique().tolist()) <= {float(base[0]), float(base[0]) + float(ulp[0])}
    error = (rounded.mean(0) - x).abs()
    assert bool((error < 5 * ulp * 0.5 / draws ** 0.5).all()), error / ulp
    assert bool(((x.to(dtype).float() - x).abs() > 0.09 * ulp).all())       # nearest: always off by the gap


def test_updates_smaller_than_half_a_step_add_up():
    torch.manual_seed(0)
    near = torch.ones(1000, 1, dtype=torch.float16)
    stochastic = near.clone()
    rows = torch.arange(1000)
    for _ in range(100):
        step = torch.full((1000, 1), 1e-4)            # a tenth of fp16's step at 1.0 (2**-10)
        near.index_add_(0, rows, step.half())
        add_rows(stochastic, rows, step, alpha=1.0)
    assert float(near.float().mean()) == 1.0, "rounding to nearest drops every such update"
    assert abs(float(stochastic.float().mean()) - 1.01) < 0.001


def init(ids):
    return {"e.weight": ids.float()[:, None] / 7 + torch.arange(DIM) / 3}


def server(table_dtype, wire="fp32", restore=None, hashed=None):
    spec = ModelSpec({"t": Table(6, {"e.weight": (DIM,)}, init, rule="rowwise_adagrad", hashed=hashed,
                                 dtype=table_dtype, wire_dtype=wire)}, lr=0.5)
    return ParameterServer("ps0", 0, 1, spec, PsMetrics(CollectorRegistry(), "ps", "ps0"), restore=restore)


def train(s, ids, grad):
    """One step as a trainer's would reach the server: the rows read, a gradient back through them."""
    rows = s.params.row_shard("e.weight")(ids)
    assert rows.dtype == torch.float32
    rows.backward(grad)
    leaf = s.params.row_shard("e.weight").stand_in
    grads = s.params.by_param({leaf if leaf is not None else s.param("e.weight"):
                               leaf.grad if leaf is not None else s.param("e.weight").grad})
    s.optimizer.apply(grads)


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_half_table_is_stored_half_and_stepped_with_fp32_gradients_and_state(name, dtype):
    torch.manual_seed(0)
    half, full = server(name, wire=name), server("fp32")
    assert half.param("e.weight").dtype == dtype
    assert half.lookup_many({"e.weight": torch.tensor([1, 4])})["e.weight"].dtype == dtype     # its wire dtype
    assert full.lookup_many({"e.weight": torch.tensor([1, 4])})["e.weight"].dtype == torch.float32
    ids, grad = torch.tensor([1, 4, 5]), torch.randn(3, DIM)
    train(half, ids, grad)
    train(full, ids, grad)
    state = half.optimizer.state_of(half.param("e.weight"))["sum"]
    assert state.dtype == torch.float32
    assert torch.equal(state, full.optimizer.state_of(full.param("e.weight"))["sum"]), "the gradient arrived fp32"
    stored = half.param("e.weight").detach()
    moved, expected = stored.float(), full.param("e.weight").detach()
    ulp = (torch.nextafter(stored, torch.full_like(stored, float("inf"))).float() - moved).abs()
    # Half a step from the initial values' rounding, under one from the update's.
    assert bool(((moved - expected).abs() <= ulp * 1.5).all()), "within 1.5 steps of the fp32 result"
    assert bool((moved[ids] != init(ids)["e.weight"].to(dtype).float()).all()), "the rows moved"
    untouched = torch.tensor([0, 2, 3])
    assert torch.equal(moved[untouched], init(untouched)["e.weight"].to(dtype).float())


def test_half_rows_checkpoint_bit_for_bit_and_into_another_precision():
    torch.manual_seed(0)
    s = server("fp16", hashed=Lifecycle())
    read = s.hashed.lookup("t", "e.weight", torch.tensor([10, -2**50, 7]), s.optimizer.steps)[0]
    assert read.dtype == torch.float32
    slots = s.hashed.tables["t"].index.find(torch.tensor([10, -2**50, 7]))
    grad = torch.sparse_coo_tensor(slots[None], torch.randn(3, DIM), (6, DIM), check_invariants=False)
    s.optimizer.apply({s.param("e.weight"): grad})
    saved = s.export_state()
    assert saved["params"]["e.weight"].dtype == torch.float16
    again, widened = server("fp16", restore=[saved], hashed=Lifecycle()), server("fp32", restore=[saved],
                                                                                  hashed=Lifecycle())
    ids = torch.tensor([7, 10, -2**50])
    rows = [x.hashed.lookup("t", "e.weight", ids, 1, training=False)[0] for x in (s, again, widened)]
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
    assert widened.param("e.weight").dtype == torch.float32
    assert s.hashed.describe()["t"]["bytes_per_row"] < widened.hashed.describe()["t"]["bytes_per_row"] - DIM * 2 + 1
