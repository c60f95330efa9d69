"""--dense allreduce's checkpoint hold on a trainer: the replica is written to the servers only
once the trainer is held, and a failed write lets it go; a server keeps the newest replica, and
its optimizer state, which a replica takes back."""
import pytest
import torch
from prometheus_client import CollectorRegistry

from ps.server.metrics import PsMetrics
from ps.server.service import ParameterServer
from services.errors import BadRequest
from trainer.lm.config import LmModelConfig
from trainer.core.replica import DenseReplica, ReplicaHold
from trainer.lm.model import _Body, model_spec


class FakeHold:
    def __init__(self, holds: bool) -> None:
        self.holds, self.calls = holds, []

    def hold(self, timeout: float) -> bool:
        self.calls.append("hold")
        return self.holds

    def release(self) -> None:
        self.calls.append("release")


def test_the_replica_is_written_once_held():
    inner, written = FakeHold(True), []
    hold = ReplicaHold(inner, lambda: written.append(list(inner.calls)))
    assert hold.hold(5.0)
    assert written == [["hold"]]            # written after the hold, before any release
    hold.release()
    assert inner.calls == ["hold", "release"]


def test_nothing_is_written_when_not_held():
    written = []
    assert not ReplicaHold(FakeHold(False), lambda: written.append(1)).hold(5.0)
    assert written == []


def test_a_failed_write_releases_the_trainer_and_fails_the_hold():
    inner = FakeHold(True)

    def broken() -> None:
        raise RuntimeError("ps1 is gone")
    with pytest.raises(RuntimeError, match="ps1 is gone"):
        ReplicaHold(inner, broken).hold(5.0)
    assert inner.calls == ["hold", "release"]


MODEL = LmModelConfig(ntoken=20, emsize=4, nhid=4, nlayers=1, optimizer="adagrad", lr=0.5)


def server() -> ParameterServer:
    return ParameterServer("ps0", 0, 1, model_spec(MODEL), PsMetrics(CollectorRegistry(), "ps", "ps0"))


def test_a_server_keeps_the_replica_of_the_latest_step_and_refuses_bad_writes():
    ps = server()
    initial = ps.dense_params()
    at = {step: {n: torch.full_like(t, float(step)) for n, t in initial.items()} for step in (3, 5)}
    assert ps.set_dense(at[5], 5)
    assert not ps.set_dense(at[3], 3), "a replica that lags (its last step failed) never overwrites a newer one"
    assert all(torch.equal(t, at[5][n]) for n, t in ps.dense_params().items())
    assert ps.set_dense(at[5], 5), "replicas of one step are equal: every trainer may write its own"
    for bad, step, why in [({**at[5], next(iter(initial)): torch.tensor(float("nan"))}, 6, "must be a"),
                           ({n: torch.full_like(t, float("inf")) for n, t in initial.items()}, 6, "not finite"),
                           (at[5], -1, "step must be an int >= 0"), ({}, 6, "no value for")]:
        with pytest.raises(BadRequest, match=why):
            ps.set_dense(bad, step)
    name = next(iter(initial))
    for state, why in [({name: {"sum": torch.zeros(3)}}, "must map names to float tensors"),
                       ({name: {"sum": torch.full_like(initial[name], float("nan"))}}, "not finite"), ([1], "a dict")]:
        with pytest.raises(BadRequest, match=why):
            ps.set_dense(at[5], 6, state)
    assert all(torch.equal(t, at[5][n]) for n, t in ps.dense_params().items()), "refused writes change nothing"


def test_a_replicas_optimizer_state_goes_to_the_servers_and_back():
    """Adagrad's sums travel with the weights: a replica restored from the servers takes the same
    next update as the one that wrote them."""
    def replica() -> DenseReplica:
        return DenseReplica("trainer0", _Body(MODEL, 0.0).lstm, MODEL.optimizer, MODEL.lr, ps.dense_params(),
                            lambda key: None, 5.0)
    ps = server()
    first = replica()
    grads = {p: torch.full_like(p, 0.1) for p in first.params}
    first.apply(grads, 1.0, 1)
    assert first.optimizer_state(), "Adagrad keeps a state"
    assert ps.set_dense(first.weights(), 1, first.optimizer_state())
    assert ps.dense_state().keys() == first.optimizer_state().keys()

    second = replica()
    second.load_optimizer_state(ps.dense_state())
    assert all(torch.equal(a, b) for a, b in zip(first.weights().values(), second.weights().values()))
    first.apply(grads, 1.0, 2)
    second.apply({q: grads[p] for p, q in zip(first.params, second.params)}, 1.0, 2)
    assert all(torch.equal(a, b) for a, b in zip(first.weights().values(), second.weights().values()))
    fresh = replica()     # the same weights without the sums: a different step
    fresh.apply({q: torch.full_like(q, 0.1) for q in fresh.params}, 1.0, 2)
    assert not all(torch.equal(a, b) for a, b in zip(fresh.weights().values(), second.weights().values()))
