"""Rows the trainers hold (``hold_rows``/``return_rows`` on a server without RPC): read with their
optimizer state, written back with it, older replicas refused, bad writes refused whole, and
the rows written marked for the next delta checkpoint."""
import pytest
import torch
from prometheus_client import CollectorRegistry

from ps.server.metrics import PsMetrics
from ps.server.service import ParameterServer
from ps.spec.model import DenseGroup, Lifecycle, ModelSpec, Table
from services.errors import BadRequest

DIM = 3


def spec(rule="adagrad", hashed=None):
    tables = {"t": Table(10, {"e.weight": (DIM,)}, lambda ids: {"e.weight": ids.float()[:, None].repeat(1, DIM)},
                         rule=rule)}
    if hashed:
        tables["h"] = Table(8, {"h.weight": (DIM,)}, lambda ids: {"h.weight": torch.zeros(ids.numel(), DIM)},
                            hashed=Lifecycle())
    return ModelSpec(tables, (DenseGroup({"w": (2,)}, lambda: {"w": torch.zeros(2)}),), optimizer="sgd", lr=0.5)


def server(model=None, shard=0, num=1):
    model = model or spec()
    return ParameterServer(f"ps{shard}", shard, num, model, PsMetrics(CollectorRegistry(), "ps", f"ps{shard}"))


def stepped(s, ids, value):
    weight = s.param("e.weight")
    grad = torch.sparse_coo_tensor(ids[None], torch.full((ids.numel(), DIM), value), weight.shape)
    s.optimizer.apply({weight: grad})


@pytest.mark.parametrize("rule,keys", [("adagrad", {"sum"}), ("rowwise_adagrad", {"sum"}), ("sgd", set())])
def test_rows_go_out_with_their_state_and_come_back(rule, keys):
    s = server(spec(rule))
    ids = torch.tensor([7, 2])
    before = s.hold_rows({"e.weight": ids})["e.weight"]
    assert torch.equal(before[0], torch.tensor([[7.0] * DIM, [2.0] * DIM]))
    assert set(before[1]) == keys and all(not v.any() for v in before[1].values()), "zeros before a first step"
    stepped(s, torch.tensor([2, 5]), 1.0)
    rows, state = s.hold_rows({"e.weight": ids})["e.weight"]
    assert rows[0].tolist() == [7.0] * DIM and rows[1][0] < 2.0
    if keys:
        assert state["sum"][0].sum() == 0 and state["sum"][1].sum() > 0

    held = {k: v + 1 for k, v in state.items()}
    assert s.return_rows({"e.weight": (ids, rows * 10, held)}, 3)
    again = s.hold_rows({"e.weight": ids})["e.weight"]
    assert torch.equal(again[0], rows * 10) and all(torch.equal(again[1][k], held[k]) for k in keys)
    assert s.param("e.weight")[5][0] < 5.0, "a row not returned keeps its own update"
    assert not s.return_rows({"e.weight": (ids, rows, state)}, 2), "an older replica never overwrites a newer one"
    assert torch.equal(s.hold_rows({"e.weight": ids})["e.weight"][0], rows * 10)


def test_a_first_write_makes_the_state_a_later_step_goes_on_from():
    s = server()
    ids = torch.tensor([4])
    assert s.return_rows({"e.weight": (ids, torch.ones(1, DIM), {"sum": torch.full((1, DIM), 4.0)})}, 0)
    stepped(s, ids, 2.0)                  # sum 4 + 4 = 8: the step divides by sqrt(8)
    expected = 1.0 - 0.5 * 2.0 / (8.0 ** 0.5 + 1e-10)
    assert torch.allclose(s.param("e.weight")[4], torch.full((DIM,), expected))


def test_a_bad_write_is_refused_whole():
    s = server(spec(hashed=True))
    ids = torch.tensor([1, 2])
    good = (ids, torch.zeros(2, DIM), {"sum": torch.zeros(2, DIM)})
    before = s.param("e.weight").detach().clone()
    bad = {
        "no such parameter": {"x.weight": good},
        "out of range": {"e.weight": (torch.tensor([1, 10]), *good[1:])},
        "twice": {"e.weight": (torch.tensor([1, 1]), *good[1:])},
        "wrong shape": {"e.weight": (ids, torch.zeros(2, DIM + 1), good[2])},
        "not finite": {"e.weight": (ids, torch.tensor([[0.0] * DIM, [float("nan")] * DIM]), good[2])},
        "state missing": {"e.weight": (ids, good[1], {})},
        "state not finite": {"e.weight": (ids, good[1], {"sum": torch.full((2, DIM), float("inf"))})},
        "not a triple": {"e.weight": (ids, good[1])},
        "hashed": {"h.weight": good},
    }
    for why, rows in bad.items():
        with pytest.raises(BadRequest):
            s.return_rows(rows, 1)
        assert torch.equal(s.param("e.weight"), before), why
    with pytest.raises(BadRequest):
        s.return_rows({"e.weight": good}, -1)
    for lookups in ({}, {"e.weight": torch.tensor([11])}, {"h.weight": ids}, {"e.weight": torch.tensor([3, 3])}):
        with pytest.raises(BadRequest):
            s.hold_rows(lookups)


def test_rows_of_another_shard_are_refused_and_written_rows_go_into_the_next_delta():
    s = server(shard=1, num=2)
    with pytest.raises(BadRequest, match="does not own"):
        s.hold_rows({"e.weight": torch.tensor([2])})
    s.params.touched.take(listed=False)
    s.params.touched.settle(True, 0)
    s.return_rows({"e.weight": (torch.tensor([3]), torch.zeros(1, DIM), {"sum": torch.zeros(1, DIM)})}, 1)
    changed, _ = s.params.touched.take()
    assert changed["t"].tolist() == [1], "global id 3 is row 1 of shard 1 of 2"
