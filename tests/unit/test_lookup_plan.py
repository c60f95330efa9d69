"""A step's lookups as the trainers' client plans them (``ps/client/lookups.py``): every request within
the servers' cap, each id asked of the server that owns it, once, and the rows put back in each
parameter's batch shape exactly as one uncut request would; a share larger than the cap is cut."""
import pytest
import torch

from ps.client.lookups import plan_lookups
from ps.spec.sharding import Slots, HashedPlan, ShardPlan, WholePlan

PLANS = {"a": ShardPlan(Slots.even(3), 50), "b": WholePlan(Slots.even(3), 7, 2), "h": HashedPlan(Slots.even(3), 90)}
TABLE_OF = {"a.weight": "a", "a.bias": "a", "b.weight": "b", "h.weight": "h"}


def row_of(param: str, ids: torch.Tensor) -> torch.Tensor:
    """What a server answers for ``ids`` of ``param``: rows that tell param and id apart."""
    salt = float(sorted(TABLE_OF).index(param))
    return torch.stack([ids.double(), ids.double() * 0.5 + salt], dim=1).to(torch.float16 if param == "b.weight"
                                                                                else torch.float32)


def lookups() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randint(0, 50, (8, 5), generator=g), "a.bias": torch.randint(0, 50, (40,), generator=g),
            "b.weight": torch.randint(0, 7, (6, 2, 3), generator=g),
            "h.weight": torch.randint(-2**62, 2**62, (30,), generator=g)}


@pytest.mark.parametrize("max_ids", [1, 4, 7, 1000])
def test_requests_stay_within_the_cap_and_put_every_row_back(max_ids):
    asked = lookups()
    plan = plan_lookups(asked, PLANS, TABLE_OF, max_ids)
    answers = []
    for server, request in plan.requests:
        assert 0 < sum(ids.numel() for ids in request.values()) <= max_ids
        for param, ids in request.items():
            assert (PLANS[TABLE_OF[param]].owner(ids.long()) == server).all(), "asked of its owner"
            assert ids.dtype == (torch.int64 if param == "h.weight" else torch.int32)
        answers.append({param: row_of(param, ids.long()) for param, ids in request.items()})
    for param in asked:
        unique = asked[param].unique().numel()
        assert sum(r[param].numel() for _, r in plan.requests if param in r) == unique, "each id asked once"
    rows = plan.collect(answers)
    for param, ids in asked.items():
        want = row_of(param, ids.reshape(-1)).float().view(*ids.shape, 2)
        assert rows[param].dtype == torch.float32 and torch.equal(rows[param], want), param


def test_one_request_per_server_while_the_cap_allows():
    plan = plan_lookups(lookups(), PLANS, TABLE_OF, 1000)
    assert sorted(server for server, _ in plan.requests) == [0, 1, 2]
    cut = plan_lookups(lookups(), PLANS, TABLE_OF, 4)
    assert len(cut.requests) > 3


def test_issued_lookups_are_collected_whatever_order_the_answers_come_in():
    # The client's issue stage hands back futures (``Fetching``): a step, or a prefetch ahead of
    # it, collects them later, and the rows are the same as when every answer came at once.
    from ps.client.fetching import Fetching
    asked = lookups()
    plan = plan_lookups(asked, PLANS, TABLE_OF, 4)
    answers = [torch.futures.Future() for _ in plan.requests]
    dense = torch.futures.Future()
    fetching = Fetching(plan, answers, [dense], [0])
    for i in reversed(range(len(answers))):
        assert not fetching.done()
        answers[i].set_result({param: row_of(param, ids.long()) for param, ids in plan.requests[i][1].items()})
    assert not fetching.done(), "the dense weights are still on their way"
    dense.set_result({"top.weight": torch.ones(2)})
    assert fetching.done()
    rows, weights = fetching.collect()
    assert torch.equal(weights["top.weight"], torch.ones(2))
    for param, ids in asked.items():
        assert torch.equal(rows[param], row_of(param, ids.reshape(-1)).float().view(*ids.shape, 2)), param


@pytest.mark.parametrize("max_ids", [3, 1000])
def test_gradients_are_spread_as_the_lookups_were_cut_a_repeated_ids_added_up(max_ids):
    # What a step pushes for rows it did not read from the servers goes back the way a lookup
    # came: each server its own ids, in the same requests, once each, with the sum of its gradients.
    asked = lookups()
    plan = plan_lookups(asked, PLANS, TABLE_OF, max_ids)
    g = torch.Generator().manual_seed(5)
    grads = {param: torch.randn(*ids.shape, 2, generator=g, dtype=torch.float64) for param, ids in asked.items()}
    pushes = plan.spread(grads)
    assert len(pushes) == len(plan.requests)
    for (server, request), push in zip(plan.requests, pushes):
        assert push.keys() == request.keys()
        for param, (ids, grad) in push.items():
            assert ids is request[param] and grad.shape == (ids.numel(), 2)
            flat, rows = asked[param].reshape(-1), grads[param].reshape(-1, 2)
            for i, got in zip(ids.long().tolist(), grad):
                assert torch.allclose(got, rows[flat == i].sum(0)), (param, i)


def test_a_parameter_asked_for_no_id_comes_back_as_no_rows_without_a_request():
    # A batch whose list column is empty in every sample names no id of its table: nothing to ask
    # a server (which refuses an empty request), yet the step gets that table's [0, D] rows.
    asked = {"a.weight": torch.tensor([3, 4]), "b.weight": torch.zeros(0, dtype=torch.long)}
    plan = plan_lookups(asked, PLANS, TABLE_OF, 1000, {"a.weight": (2,), "b.weight": (2,)})
    assert all("b.weight" not in request for _, request in plan.requests)
    rows = plan.collect([{p: row_of(p, ids.long()) for p, ids in request.items()} for _, request in plan.requests])
    assert rows["b.weight"].shape == (0, 2) and rows["a.weight"].shape == (2, 2)
    assert plan.spread({"b.weight": torch.zeros(0, 2)}) == [{} for _ in plan.requests]


@pytest.mark.parametrize("max_ids", [4, 1000])
def test_ids_already_distinct_plan_as_they_would_deduplicated(max_ids):
    # A cache's split hands the plan sorted, distinct ids: planned without sorting them again, the
    # requests, the rows collected and the gradients spread are those of the ordinary plan.
    asked = {p: ids.unique() for p, ids in lookups().items()}
    plain = plan_lookups(asked, PLANS, TABLE_OF, max_ids)
    told = plan_lookups(asked, PLANS, TABLE_OF, max_ids, distinct=set(asked))
    assert [(s, sorted(r)) for s, r in plain.requests] == [(s, sorted(r)) for s, r in told.requests]
    for (_, a), (_, b) in zip(plain.requests, told.requests):
        assert all(torch.equal(a[p], b[p]) for p in a)
    answers = [{p: row_of(p, ids.long()) for p, ids in r.items()} for _, r in told.requests]
    got, want = told.collect(answers), plain.collect(answers)
    assert all(torch.equal(got[p], want[p]) for p in asked)
    grads = {p: torch.randn(*ids.shape, 2) for p, ids in asked.items()}
    for a, b in zip(plain.spread(grads), told.spread(grads)):
        assert a.keys() == b.keys() and all(torch.equal(a[p][1], b[p][1]) for p in a)


def test_gradients_of_rows_read_before_a_change_of_layout_go_to_their_owners_now():
    from ps.client.fetching import Fetching, replanned
    from ps.client.lookups import LookupPlan
    from ps.client.routes import Routes
    old = Slots.even(2, 12)
    new = old.rebalanced(["ps0", "ps1", "ps2"])
    routes = Routes(new, {"a": ShardPlan(new, 50)}, {"a.w": "a"}, 100, {}, {})
    assert routes.servers == ["ps0", "ps1", "ps2"] and routes.epoch == new.epoch > old.epoch
    read = Fetching(LookupPlan([], {}), [], [], [], servers=("ps0", "ps1"), epoch=old.epoch)
    ids = torch.arange(0, 24)
    pushes = [(0, {"a.w": (ids[ids % 2 == 0], torch.ones(12, 3))}, {}), (1, {}, {"w": torch.ones(2)})]
    again = replanned(read, pushes, routes)
    for k, rows, _ in again:
        for param, (sent, _) in rows.items():
            assert bool((ShardPlan(new, 50).owner(sent) == k).all())
    assert sorted(i for _, rows, _ in again for i in rows.get("a.w", (torch.tensor([]),))[0].tolist()) == \
        ids[ids % 2 == 0].tolist()
    assert [(k, list(d)) for k, r, d in again if d] == [(1, ["w"])]
    assert replanned(Fetching(LookupPlan([], {}), [], [], [], servers=("ps0",), epoch=new.epoch), pushes, routes) is pushes
