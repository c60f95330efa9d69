"""Hot rows replicated among the trainers (``--cache-staleness 0``), without a cluster: the group's
choice is the same on every member whatever each counted, rows leave and come with their state,
a step takes them with the way back for its gradients, and the rule steps them as a server steps
its table."""
import pytest
import torch

from ps.client.cache import HotRows
from ps.spec.rules import rule
from trainer.core.hot_rows import ReplicatedRows, row_cache
from trainer.ctr.config import CtrTrainerConfig, CtrUpSettings

P = "t.weight"
DIM = 2


class FakeServers:
    """A table of 100 rows (row i: i, i) and its row-wise Adagrad state, as ``ServerRows`` faces it."""

    def __init__(self) -> None:
        self.rows = torch.arange(100.0)[:, None].repeat(1, DIM)
        self.sum = torch.zeros(100)
        self.given: list[tuple[list[int], int]] = []

    def hold(self, lookups):
        return {p: (self.rows[ids].clone(), {"sum": self.sum[ids].clone()}) for p, ids in lookups.items()}

    def give_back(self, held, step):
        for ids, rows, state in held.values():
            self.rows[ids], self.sum[ids] = rows, state["sum"]
            self.given.append((ids.tolist(), step))


def member(servers, capacity=3):
    hot = ReplicatedRows(capacity, every=2)
    hot.bind(servers, {P: rule("rowwise_adagrad")}, 0.5, {P: 100})
    return hot


def named(hot, *batches):
    for ids in batches:
        hot.take(P, torch.tensor(ids), 0)


def choose_together(members, step, writer=0, log=None):
    """Every member's choice at ``step``, over every member's counts (as all_gather_object gives them);
    ``log`` records each member's collectives, and the servers' writes, in order."""
    everyone = [{p: hot._counted(p) for p in sorted(hot._named)} for hot in members]

    def gather(k):
        def collective(obj):
            if log is not None:
                log.append((k, "gather" if obj is not None else "barrier", len(members[0]._servers.given)))
            return everyone
        return collective
    return [hot.choose(step, gather(k), writes=k == writer) for k, hot in enumerate(members)]


def test_the_group_chooses_the_same_rows_whatever_each_member_counted():
    servers = FakeServers()
    a, b = member(servers), member(servers)
    named(a, [5, 5, 5, 7, 9])
    named(b, [7, 7, 9, 9, 11, 11])      # group: 5 x3, 7 x3, 9 x3, 11 x2 -> the 3 most named
    assert choose_together([a, b], 3) == [False, False], "not due: every 2 steps"
    assert choose_together([a, b], 4) == [True, True]
    assert a.held[P].ids.tolist() == b.held[P].ids.tolist() == [5, 7, 9]
    assert torch.equal(a.held[P].rows, servers.rows[[5, 7, 9]]) and a.rows == 3


def test_ties_go_to_the_lower_id_and_the_capacity_holds():
    hot = member(FakeServers(), capacity=2)
    named(hot, [30, 20, 10, 40])
    choose_together([hot], 2)
    assert hot.held[P].ids.tolist() == [10, 20]


def test_rows_that_leave_go_back_once_with_their_state_and_rows_that_come_are_read():
    servers = FakeServers()
    a, b = member(servers, capacity=2), member(servers, capacity=2)
    named(a, [1, 1, 2, 2])
    named(b, [1, 2])
    choose_together([a, b], 2)
    with torch.no_grad():
        for hot in (a, b):
            hot.held[P].rows.add_(100)
            hot.held[P].state["sum"].add_(7)
    named(a, [2, 3, 3, 3])
    named(b, [3, 2])
    log = []
    choose_together([a, b], 4, writer=1, log=log)
    assert servers.given == [([1], 4)], "row 1 left, given back by the writer alone"
    # Each member waits at a barrier once rows leave; the writer reaches it after its write, so no
    # member reads a row that left (its reads ahead go out next) before the servers hold it again.
    assert log == [(0, "gather", 0), (0, "barrier", 0), (1, "gather", 0), (1, "barrier", 1)], log
    assert servers.rows[1].tolist() == [101.0, 101.0] and servers.sum[1] == 7
    for hot in (a, b):
        assert hot.held[P].ids.tolist() == [2, 3]
        assert hot.held[P].rows[:, 0].tolist() == [102.0, 3.0], "row 2 kept as held; row 3 read"
        assert hot.held[P].state["sum"].tolist() == [7.0, 0.0]
        assert hot.held[P].rows.is_leaf and hot.held[P].rows.requires_grad


def test_a_step_takes_held_rows_with_the_way_back_and_counts_only_training_reads():
    hot = member(FakeServers())
    named(hot, [4, 4, 6])
    choose_together([hot], 2)
    with torch.no_grad():
        hot.take(P, torch.tensor([4, 8]), 0)
    assert not hot._named, "an evaluation's read is not counted"
    taken = hot.take(P, torch.tensor([[8, 4], [4, 6]]), 0)
    assert taken.hit_ids.tolist() == [4, 6] and taken.miss_ids.tolist() == [8]
    rows = taken.assemble(taken.hit_rows, torch.full((1, DIM), -1.0))
    assert rows[:, :, 0].tolist() == [[-1.0, 4.0], [4.0, 6.0]]
    rows.sum().backward()
    assert hot.held[P].rows.grad[:, 0].tolist() == [2.0, 1.0], "row 4 named twice, 6 once"


def test_the_rule_steps_held_rows_as_a_server_steps_its_table_and_leaves_the_untouched():
    servers = FakeServers()
    hot = member(servers)
    named(hot, [3, 5, 9])
    choose_together([hot], 2)
    table, state = servers.rows.clone(), {"sum": servers.sum.clone()}
    grad = torch.tensor([[0.5, -1.0], [0.0, 0.0], [2.0, 0.25]])       # rows 3, 5, 9: 5 untouched
    crossed = []
    averaged = hot.averaged({hot.held[P].rows: grad}, lambda mask: mask,
                            lambda flat: crossed.append(flat.clone()) or flat)
    assert crossed[0].tolist() == [0.5, -1.0, 2.0, 0.25], "only touched rows cross"
    hot.apply(averaged, 1.0)
    touched = torch.tensor([3, 9])
    sparse = torch.sparse_coo_tensor(touched[None], grad[[0, 2]], table.shape)
    rule("rowwise_adagrad").step(table, sparse, state, 0.5)
    assert torch.equal(hot.held[P].rows.detach(), table[[3, 5, 9]])
    assert torch.equal(hot.held[P].state["sum"], state["sum"][[3, 5, 9]])
    assert hot.held[P].rows[1].tolist() == [5.0, 5.0]


def test_the_group_averages_the_rows_any_member_touched_and_no_other():
    a = member(FakeServers())
    named(a, [1, 2, 3])
    choose_together([a], 2)
    mine = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])          # this member touched row 1
    theirs = torch.tensor([False, False, True])                         # another touched row 3
    sent = []
    averaged = a.averaged({a.held[P].rows: mine}, lambda mask: mask | theirs,
                          lambda flat: sent.append(flat) or flat / 2)
    assert sent[0].tolist() == [1.0, 1.0, 0.0, 0.0], "row 1's gradient and row 3's zeros"
    assert averaged[a.held[P].rows].tolist() == [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]
    untouched = member(FakeServers())
    assert untouched.averaged({}, lambda mask: mask, lambda flat: flat) == {}, "nothing held, nothing sent"


def test_a_newcomer_takes_the_groups_rows_from_its_state():
    hot = member(FakeServers())
    named(hot, [1, 2])
    choose_together([hot], 2)
    newcomer = member(FakeServers())
    newcomer.load(hot.state())
    assert newcomer.held[P].ids.tolist() == [1, 2] and torch.equal(newcomer.held[P].rows, hot.held[P].rows)
    assert newcomer.held[P].rows.requires_grad


def test_the_flags_choose_the_cache_and_staleness_0_needs_the_replica():
    assert row_cache(0, 0) is None
    assert type(row_cache(10, 2)) is HotRows
    assert type(row_cache(10, 0)) is ReplicatedRows
    base = {"consistency": "sync", "cache_rows": 10, "cache_staleness": 0}
    assert CtrUpSettings.model_validate({**base, "dense": "allreduce"})
    with pytest.raises(ValueError, match=r"needs --dense allreduce \(--consistency sync or hybrid\)"):
        CtrUpSettings.model_validate({**base, "dense": "ps"})
    with pytest.raises(ValueError, match=r"needs --dense allreduce"):
        CtrTrainerConfig.model_validate({"cache_rows": 10, "cache_staleness": 0, "dense": "ps"})
    # hybrid replicates the dense weights unless told otherwise, and with them the hot rows.
    hybrid = CtrUpSettings.model_validate({**base, "consistency": "hybrid"})
    assert hybrid.dense is None and hybrid.dense_at == "allreduce"
    with pytest.raises(ValueError, match="keeps the dense weights replicated on the trainers: --dense allreduce"):
        CtrUpSettings.model_validate({"consistency": "hybrid", "dense": "ps"})
    with pytest.raises(ValueError, match="on the servers: --dense ps"):
        CtrUpSettings.model_validate({"dense": "allreduce"})
    with pytest.raises(ValueError, match="replicates the hot rows among the trainers"):
        CtrUpSettings.model_validate({**base, "cache_staleness": 1, "dense": "allreduce"})

