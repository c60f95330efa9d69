"""A step whose backward runs on the trainer: its leaves' gradients read as a context's are, and
gathered one message a server, a row named twice sent once with its gradients summed; under hybrid,
rows refused (not finite) still leave every replica the same averaged update; and each server's
update says when the step first read there, which is how its staleness is counted."""
from types import SimpleNamespace

import pytest
import torch

from ps.client.fetching import Fetching, GradOf, earliest, merged
from ps.client.lookups import plan_lookups
from ps.spec.sharding import Slots, ShardPlan
from ps.client.step_end import StepEnd
from services.errors import UpdateRefused
from trainer.ctr.config import CtrUpSettings


def test_a_leaf_gradient_is_read_as_a_context_gives_it():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    (3 * a).sum().backward()
    grads = GradOf()
    assert a in grads and b not in grads
    assert torch.equal(grads[a], torch.full((2,), 3.0)) and grads.get(b) is None


def test_pushes_are_gathered_per_server_each_row_once():
    rows = lambda ids, value: (torch.tensor(ids), torch.full((len(ids), 2), value))  # noqa: E731
    w = torch.ones(3)
    out = merged([(0, {"t": rows([4, 1], 1.0)}, {}), (1, {"t": rows([7], 2.0)}, {}),
                  (0, {"t": rows([1, 9], 10.0), "u": rows([2], 5.0)}, {"w": w})])
    assert sorted(out) == [0, 1]
    ids, grad = out[0][0]["t"]
    got = dict(zip(ids.tolist(), grad[:, 0].tolist()))
    assert got == {1: 11.0, 4: 1.0, 9: 10.0}, "id 1 came in two answers: once, its gradients summed"
    assert out[0][0]["u"][0].tolist() == [2] and out[0][1]["w"] is w
    assert out[1][0]["t"][0].tolist() == [7] and out[1][1] == {}


def test_local_backward_with_a_hashed_table_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--backward local with --tables C3: a hashed table's reads"):
        CtrUpSettings.model_validate({"tables": "C3", "backward": "local"})
    assert CtrUpSettings.model_validate({"tables": "C3"}).backward is None
    assert CtrUpSettings.model_validate({"backward": "local"}).backward == "local"


class _Clock:
    def __init__(self) -> None:
        self.granted, self.arrived = SimpleNamespace(step=7), []

    def arrive(self, clip: float, refused: bool = False) -> tuple[None, float]:
        self.arrived.append(refused)
        return None, 0.0


class _Replica:
    """The dense replica as hybrid steps it: the group's average is the trainer's own here."""

    def __init__(self) -> None:
        self.applied: list[tuple[dict, float, int]] = []

    def averaged(self, grads: dict) -> dict:
        return grads

    def sq_norm(self, grads: dict) -> float:
        return sum(float(g.pow(2).sum()) for g in grads.values())

    def apply(self, grads: dict, coef: float, step: int) -> None:
        self.applied.append((grads, coef, step))


def test_hybrid_rows_refused_still_step_the_replica_and_tell_the_clock():
    clock, replica, asked = _Clock(), _Replica(), []
    client = SimpleNamespace(consistency=SimpleNamespace(clocked=True), clock=clock,
                             routes=SimpleNamespace(servers=["ps0", "ps1"], dense_shards=[], epoch=0), ask=lambda *a, **_: asked.append(a))
    w = torch.ones(2)
    end = StepEnd(client, None, lambda: {w: torch.full((2,), 3.0)})
    rows = {0: ({"t": (torch.tensor([1]), torch.tensor([[float("nan"), 1.0]]))}, {}),
            1: ({"t": (torch.tensor([2]), torch.tensor([[1.0, 1.0]]))}, {})}
    with pytest.raises(UpdateRefused, match="not finite|norm is nan"):
        end.apply_own(0.0, 1.0, rows, False, None, replica)
    assert asked == [], "no server was asked to apply rows whose gradients are not finite"
    assert clock.arrived == [True], "the clock heard the step end, refused"
    (grads, coef, step), = replica.applied
    # Every trainer applies the same average, clipped by its own norm (sqrt(18) > clip 1).
    assert step == 7 and coef == pytest.approx(1.0 / (18 ** 0.5 + 1e-6))
    assert torch.equal(grads[w], torch.full((2,), 3.0))


def _answered(value) -> torch.futures.Future:
    f: torch.futures.Future = torch.futures.Future()
    f.set_result(value)
    return f


def test_a_local_step_hands_each_server_its_earliest_read():
    # Two tables over two servers, the first cut into two requests per server (a cap of 2 ids).
    plans = {"a": ShardPlan(Slots.even(2), 10), "b": ShardPlan(Slots.even(2), 10)}
    plan = plan_lookups({"a": torch.tensor([0, 1, 2, 3]), "b": torch.tensor([5])}, plans, {"a": "a", "b": "b"}, 2)
    assert [k for k, _ in plan.requests] == [0, 1, 1]
    stamps = [11, 9, 12]     # each server's updates so far when it answered that request
    answers = [_answered((stamp, {p: torch.full((len(ids), 1), float(k)) for p, ids in ask.items()}))
               for stamp, (k, ask) in zip(stamps, plan.requests)]
    fetching = Fetching(plan, answers, [], [], stamped=True)
    rows, _ = fetching.adopted()
    assert rows["a"].flatten().tolist() == [0.0, 1.0, 0.0, 1.0] and rows["b"].flatten().tolist() == [1.0]
    assert fetching.stamps() == [(0, 11), (1, 9), (1, 12)]
    later = Fetching(plan, [_answered((20, {p: torch.zeros(len(ids), 1) for p, ids in ask.items()}))
                            for _, ask in plan.requests], [], [], stamped=True)
    later.collect()
    assert earliest(fetching.stamps() + later.stamps()) == {0: 11, 1: 9}, "each server's first read"


def test_each_server_is_told_when_the_step_first_read_there():
    asked = []
    client = SimpleNamespace(consistency=SimpleNamespace(clocked=False),
                             routes=SimpleNamespace(servers=["ps0", "ps1"], dense_shards=[], epoch=0),
                             ask=lambda *a, **_: asked.append(a) or _answered(None))
    end = StepEnd(client, None, lambda: {}, {1: 9})
    rows = {0: ({"t": (torch.tensor([1]), torch.ones(1, 2))}, {}),
            1: ({"t": (torch.tensor([2]), torch.ones(1, 2))}, {})}
    end.apply_own(0.0, 0.0, rows, False, None, None)
    # (server, method, context, coef, weights, mark, rows, dense, read_at): ps0 did not answer a read.
    assert [(a[0], a[-1]) for a in asked] == [("ps0", None), ("ps1", 9)]


def test_gradients_pushed_before_a_change_of_layout_go_to_the_rows_owners_under_the_steps_end():
    from ps.client.routes import Routes
    from ps.client.session import StepSession
    from ps.spec.sharding import ShardPlan, Slots
    old = Slots.even(2, 12)
    new = old.rebalanced(["ps0", "ps1", "ps2"])
    routes = lambda slots: Routes(slots, {"a": ShardPlan(slots, 50)}, {"a.w": "a"}, 100, {}, {})  # noqa: E731
    asked = []
    client = SimpleNamespace(local_backward=True, steps=0, session=None, routes=routes(old), counts=None,
                             consistency=SimpleNamespace(averaged=False, clocked=False, dense_modes=()),
                             clock=SimpleNamespace(granted=None),
                             ask=lambda *a, **kw: asked.append((a, kw)) or _answered(None))
    ids = torch.arange(0, 24)
    w = torch.ones(1, requires_grad=True)
    with StepSession(client) as session:
        session.push({"a.w": ids}, {"a.w": torch.ones(24, 3)})
        client.routes = routes(new)          # the leader's layout followed before the step ends
        session.finish((w * 2).sum(), clip=0.0)
    sent = {a[0]: a[6] for a, kw in asked}
    assert sorted(sent) == ["ps0", "ps1", "ps2"] and {kw["epoch"] for _, kw in asked} == {new.epoch}
    plan = ShardPlan(new, 50)
    for k, name in enumerate(["ps0", "ps1", "ps2"]):
        rows = sent[name].get("a.w")
        assert rows is None or bool((plan.owner(rows[0]) == k).all()), (name, rows)
    assert sorted(i for rows in sent.values() if "a.w" in rows for i in rows["a.w"][0].tolist()) == ids.tolist()
