"""A request planned with another layout than the server's: served for what the server holds now,
refused as ``StaleLayout`` (counted) for what it does not; without an epoch, a bad request."""
import pytest
import torch
from prometheus_client import CollectorRegistry

from ps.server.metrics import PsMetrics
from ps.server.service import ParameterServer
from ps.spec.sharding import first_slots
from services.errors import BadRequest, StaleLayout
from trainer.lm.config import LmModelConfig
from trainer.lm.model import model_spec

MODEL = LmModelConfig(ntoken=50, emsize=4, nhid=4, nlayers=1, lr=0.1, optimizer="adagrad")


@pytest.fixture
def server():
    slots = first_slots(model_spec(MODEL), 2).rebalanced(["ps0", "ps1", "ps2"])      # epoch 2
    return ParameterServer("ps1", 1, slots, model_spec(MODEL), PsMetrics(CollectorRegistry(), "ps", "ps1"))


def _ids(server, mine: bool) -> torch.Tensor:
    plan = server.layout.plans["vocabulary"]
    ids = torch.arange(MODEL.ntoken)
    return ids[(plan.owner(ids) == server.shard) == mine][:3]


def test_a_request_of_an_older_epoch_is_served_for_what_the_server_holds(server):
    server.before_call("trainer0", "lookup_many", 1)
    rows = server.lookup_many({"embedding.weight": _ids(server, True)})
    assert rows["embedding.weight"].shape == (3, MODEL.emsize)
    assert server.refusals.stale == 0


def test_one_naming_rows_that_moved_is_refused_as_stale_and_counted(server):
    server.before_call("trainer0", "lookup_many", 1)
    with pytest.raises(StaleLayout, match="planned with layout 1, this server serves by layout 2"):
        server.lookup_many({"embedding.weight": _ids(server, False)})
    assert server.refusals.stale == 1
    assert server.metrics.requests_stale._value.get() == 1


def test_the_dense_tensors_and_operations_ask_for_the_same_epoch(server):
    server.before_call("trainer0", "dense_params", 1)
    with pytest.raises(StaleLayout):
        server.dense_params()
    server.before_call("trainer0", "dense_params", 2)
    server.dense_params()
    server.before_call("trainer0", "op", 3)         # a newer epoch than the server's: it is the stale one
    with pytest.raises(StaleLayout):
        server.op("decode", torch.zeros(1, MODEL.nhid))
    assert server.refusals.stale == 2


def test_without_an_epoch_rows_held_elsewhere_are_a_bad_request(server):
    server.before_call("ps0", "lookup_many", 0)
    with pytest.raises(BadRequest, match="does not own") as refused:
        server.lookup_many({"embedding.weight": _ids(server, False)})
    assert not isinstance(refused.value, StaleLayout) and server.refusals.stale == 0
