"""Counted updates (``--count-updates``) without RPC: a counting rule steps as its rule does and
counts each row a step names once; the counts move with their rows in a live change of layout
(copied ahead while updates go on) and match the trainer's acknowledged steps slot by slot; an
update lost or applied twice shows in the tally; what counting refuses, and a server that does
not count restoring a counting server's shard."""
import pytest
import torch
from prometheus_client import CollectorRegistry

from ps.client.counts import UpdateCounts
from ps.server.counts import applied_counts
from ps.server.metrics import PsMetrics
from ps.server.service import ParameterServer
from ps.spec.config import PsConfig
from ps.spec.counting import COUNT_KEY, Counted, counting, tally
from ps.spec.rules import RowWiseAdagrad
from ps.spec.sharding import first_slots
from services.errors import NotSupported
from tests.support.tiny import DIM, TinyServerConfig, model
from tests.unit.test_live_relayout import move

SLOTS = 8


def server(name, slots, counted=True):
    spec = model(TinyServerConfig(rows=50))
    return ParameterServer(name, slots.position(name), slots, counting(spec) if counted else spec,
                           PsMetrics(CollectorRegistry(), "ps", name))


def update(servers, ids, counts=None):
    """One trainer step naming ``ids`` of the big table, applied on every server that owns some,
    and acknowledged to ``counts``."""
    for s in servers:
        plan = s.layout.plans["big"]
        if s.shard >= plan.num_shards:
            continue
        local = plan.to_local(ids[plan.owner(ids) == s.shard])
        if local.numel():
            param = s.params["big.weight"]
            s.optimizer.apply({param: torch.sparse_coo_tensor(local[None], torch.ones(local.numel(), DIM),
                                                              param.shape)})
    if counts is not None:
        counts.record([{"big.weight": ids}], acked=True)


def applied(servers):
    """The servers' counts summed, slot by slot (each slot held by one)."""
    out = None
    for s in servers:
        mine = torch.tensor(applied_counts(s)["applied"]["big"])
        out = mine if out is None else out + mine
    return {"big": out.tolist()}


def test_a_counted_rule_steps_as_its_rule_and_counts_each_row_a_step_names_once():
    plain, counted = torch.zeros(5, 3), torch.zeros(5, 3)
    state_plain, state_counted = {"sum": torch.zeros(5)}, {"sum": torch.zeros(5)}
    rule = Counted(RowWiseAdagrad())
    assert rule.name == "rowwise_adagrad" and rule.row_state == ("sum", COUNT_KEY)
    for rows in ([0, 2, 2], [2, 4], [0]):       # row 2 named twice in the first step: one update
        grad = torch.sparse_coo_tensor(torch.tensor([rows]), torch.ones(len(rows), 3), (5, 3))
        RowWiseAdagrad().step(plain, grad, state_plain, 0.1)
        rule.step(counted, grad, state_counted, 0.1)
    assert torch.equal(plain, counted) and torch.equal(state_plain["sum"], state_counted["sum"])
    assert state_counted[COUNT_KEY].tolist() == [2, 0, 2, 0, 1]


def test_counts_move_with_their_rows_and_match_the_acknowledged_steps_slot_by_slot():
    first = first_slots(model(TinyServerConfig(rows=50)), 2, count=SLOTS)
    servers = [server("ps0", first), server("ps1", first), server("ps2", first)]
    counts = UpdateCounts(["big"], {"big.weight": "big"}, SLOTS)
    g = torch.Generator().manual_seed(3)

    def steps(n=4):
        for _ in range(n):
            update(servers, torch.randint(0, 50, (12,), generator=g), counts)

    steps()
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    move(servers, first, grown, meanwhile=steps)        # updates while the rows are copied ahead
    steps()
    shrunk = grown.rebalanced(["ps0", "ps2"])
    move(servers, grown, shrunk, meanwhile=steps)
    steps()
    held = applied(servers)
    assert applied_counts(servers[1])["applied"]["big"] == [0] * SLOTS       # ps1 gave every slot away
    result = tally(counts.snapshot()["acked"], counts.snapshot()["unsure"], held)
    assert result["acknowledged"] == result["applied"] > 0
    assert (result["lost"], result["twice"], result["slots_off"]) == (0, 0, 0)

    # An acknowledged update no server applied, and one applied twice, each show in their slot.
    lost = torch.tensor([5, 13])                        # slot 5, twice
    counts.record([{"big.weight": lost}], acked=True)
    again = torch.tensor([6])
    update(servers, again)
    update(servers, again, counts)
    result = tally(counts.snapshot()["acked"], counts.snapshot()["unsure"], applied(servers))
    assert (result["lost"], result["twice"], result["slots_off"]) == (2, 1, 2)
    # A step that failed after it was sent may have been applied: not counted as twice.
    counts.record([{"big.weight": again}], acked=False)
    assert tally(counts.snapshot()["acked"], counts.snapshot()["unsure"], applied(servers))["twice"] == 0


def test_a_server_that_does_not_count_restores_a_counting_shard_without_its_counts():
    first = first_slots(model(TinyServerConfig(rows=50)), 1, count=SLOTS)
    counting_server = server("ps0", first)
    update([counting_server], torch.arange(10))
    saved = counting_server.export_state()
    plain = ParameterServer("ps0", 0, first, model(TinyServerConfig(rows=50)),
                            PsMetrics(CollectorRegistry(), "ps", "ps0"), restore=[saved])
    assert COUNT_KEY not in plain.optimizer.live_state(plain.params["big.weight"])
    assert torch.equal(plain.params["big.weight"], counting_server.params["big.weight"])
    with pytest.raises(NotSupported, match="--count-updates"):
        applied_counts(plain)


def test_counting_is_refused_where_it_cannot_count():
    with pytest.raises(ValueError, match="averages"):
        PsConfig(count_updates=True, consistency="sync")
    PsConfig(count_updates=True, consistency="ssp:2")
    from trainer.lm.config import LmModelConfig
    from trainer.lm.model import model_spec
    with pytest.raises(ValueError, match="operations of their own"):
        counting(model_spec(LmModelConfig(ntoken=60, emsize=4, nhid=4, nlayers=1)))
