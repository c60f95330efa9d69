"""A change of layout on live servers (no RPC): what leaves a source is taken by its destination
and each rebuilds its shard by the new layout, every row, its optimizer state and the dense
tensors bit for bit where the layout puts them; a server that joins holds nothing until then."""
import threading

import pytest
import torch

from tests.support.rows import held
from prometheus_client import CollectorRegistry

from ps.leader.moves import by_destination, change_name
from ps.server.metrics import PsMetrics
from ps.server.moves import Gate, merged
from ps.server.precopy import by_rows
from ps.server.relayout import ShardMoves
from ps.server.service import ParameterServer
from ps.spec.sharding import first_slots
from trainer.lm.config import LmModelConfig
from trainer.lm.model import model_spec

MODEL = LmModelConfig(ntoken=60, emsize=4, nhid=4, nlayers=2, lr=0.1, optimizer="adagrad")
ROWS = ("embedding.weight", "decoder.weight", "decoder.bias")


def server(name, slots):
    return ParameterServer(name, slots.position(name), slots, model_spec(MODEL),
                           PsMetrics(CollectorRegistry(), "ps", name))


def whole(servers):
    """Every parameter and its Adagrad sum over the servers, rows by id."""
    out = {}
    for s in servers:
        rows, ids = held(s.layout.plans["vocabulary"].global_ids(s.shard))
        for name, p in zip(s.params.names, s.optimizer.params):
            acc = s.optimizer.optimizer.state.get(p, {}).get("sum", torch.zeros_like(p))
            if name in ROWS:
                value, total = out.setdefault(name, (torch.full((MODEL.ntoken, *p.shape[1:]), float("nan")),
                                                     torch.full((MODEL.ntoken, *p.shape[1:]), float("nan"))))
                value[ids], total[ids] = p.detach()[rows], acc[rows]
            else:
                assert name not in out, f"{name} held twice"
                out[name] = (p.detach().clone(), acc.clone())
    return out


def rows_by_id(servers):
    """Every row of the servers' tables but the hashed, by (parameter, id); each held once."""
    out = {}
    for s in servers:
        for table, plan in s.layout.plans.items():
            rows, ids = held(plan.global_ids(s.shard))
            for name in s.layout.table_params[table]:
                for i, row in zip(ids.tolist(), s.params[name].detach()[rows]):
                    assert (name, i) not in out, f"{name}[{i}] held twice"
                    out[name, i] = row.clone()
    return out


def take(servers, old, new, stage, change, only=None):
    """Each destination's parts of ``old.moves(new)`` at ``stage`` for ``change``, as the leader
    asks them (an early part a piece of tables at a time, as ``take_part`` takes it); ``only``:
    from these sources alone."""
    by_name = {s.name: s for s in servers}
    for dest, sources in by_destination(old.moves(new)).items():
        for source, (slots, units) in sources.items():
            if only is not None and source not in only:
                continue
            moves = ShardMoves(by_name[source])
            pieces = by_rows(by_name[dest].layout, old.position(source)) if stage == "early" else [None]
            part = merged([moves.part(slots, units, stage, piece) for piece in pieces])
            by_name[dest].staged.keep(change, source, stage, part)


def move(servers, old, new, meanwhile=None):
    """The change of ``old`` to ``new`` on ``servers``: all of it at once; or (``meanwhile``: what
    training does while the change copies ahead) the early parts, ``meanwhile()``, every shard
    built aside, ``meanwhile()`` again, then the changes since."""
    change = change_name(new.epoch)
    if meanwhile is not None:
        take(servers, old, new, "early", change)
        meanwhile()
        for s in servers:
            ShardMoves(s).prepare(new.to_dict(), change)
        meanwhile()
    take(servers, old, new, "all" if meanwhile is None else "changes", change)
    for s in servers:
        ShardMoves(s).relayout(new.to_dict(), change)


def test_a_server_joins_empty_takes_its_share_and_hands_it_back():
    first = first_slots(model_spec(MODEL), 2)
    a, b = server("ps0", first), server("ps1", first)
    for s in (a, b):
        g = torch.Generator().manual_seed(s.shard)
        s.optimizer.apply({p: torch.randn(p.shape, generator=g) for p in s.optimizer.params})
    before = whole([a, b])
    c = server("ps2", first)                     # beside the cluster: not in its layout yet
    assert sum(c.info().tables.values()) == 0 and c.info().dense == ()
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    move([a, b, c], first, grown)
    assert [s.layout.epoch for s in (a, b, c)] == [2, 2, 2]
    assert sorted(sum(s.info().tables.values()) for s in (a, b, c)) == [20, 20, 20]
    for group in ([a, b, c],):
        after = whole(group)
        for name, (value, acc) in before.items():
            assert torch.equal(after[name][0], value) and torch.equal(after[name][1], acc), name
    shrunk = grown.rebalanced(["ps0", "ps2"])
    move([a, b, c], grown, shrunk)
    assert sum(b.info().tables.values()) == 0 and b.info().dense == ()
    after = whole([a, c])
    for name, (value, acc) in before.items():
        assert torch.equal(after[name][0], value) and torch.equal(after[name][1], acc), name
    assert a.optimizer.steps == c.optimizer.steps == 1


def test_a_rebuild_lacking_what_the_new_layout_gives_a_server_fails_and_keeps_its_shard():
    first = first_slots(model_spec(MODEL), 2)
    a = server("ps0", first)
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    shrunk = grown.rebalanced(["ps0"])            # ps0 would own everything, and took nothing
    with pytest.raises(ValueError, match="lack"):
        ShardMoves(a).relayout(shrunk.to_dict(), change_name(shrunk.epoch))
    assert a.layout.slots == first and sum(a.info().tables.values()) == 30


def test_the_gate_holds_requests_while_a_change_is_inside_and_waits_for_those_inside():
    gate, order = Gate(), []
    gate.enter()
    closing = threading.Thread(target=lambda: [order.append("closing"), gate.closed().__enter__(),
                                               order.append("closed")])
    closing.start()
    closing.join(0.2)
    assert order == ["closing"]                   # waits for the request inside
    gate.leave()
    closing.join(5)
    assert order == ["closing", "closed"]


@pytest.mark.parametrize("ahead", [False, True], ids=["all-held", "copied-ahead"])
def test_a_hashed_tables_live_rows_move_with_their_counts_and_state(ahead):
    from tests.unit.test_hashed_server import IDS, by_id, spec, step
    model = spec(40)
    first = first_slots(model, 2)
    old = [ParameterServer(n, k, first, model, PsMetrics(CollectorRegistry(), "ps", n))
           for k, n in enumerate(("ps0", "ps1"))]
    for k in range(3):
        step(old, IDS[k:k + 6], k + 1)
    before = by_id(old)
    more = iter(range(3, 9))
    third = ParameterServer("ps2", 2, first, model, PsMetrics(CollectorRegistry(), "ps", "ps2"))
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    # Ids admitted and rows written while it copies ahead: a hashed table is copied whole, held.
    move([*old, third], first, grown, meanwhile=(lambda: step(old, IDS[next(more):][:6], 7)) if ahead else None)
    if ahead:
        replay = [ParameterServer(n, k, first, model, PsMetrics(CollectorRegistry(), "ps", n))
                  for k, n in enumerate(("ps0", "ps1"))]
        for k in range(3):
            step(replay, IDS[k:k + 6], k + 1)
        for k in (3, 4):
            step(replay, IDS[k:][:6], 7)
        before = by_id(replay)
    after = by_id([*old, third])
    assert after.keys() == before.keys() and len(by_id([third])) > 0
    for i, (value, acc, seen, hits) in before.items():
        assert torch.equal(after[i][0], value) and after[i][1:] == (acc, seen, hits), i


def test_copies_with_every_core_on_two_threads_at_once_leave_the_thread_count_as_it_was():
    from ps.server.update import all_cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

        def first():
            with all_cores():
                first_in.set()
                second_in.wait(10)
            first_out.set()

        def second():
            first_in.wait(10)
            with all_cores():           # entered while the first holds it, left after the first left
                second_in.set()
                first_out.wait(10)
        threads = [threading.Thread(target=f) for f in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def train(servers, seed):
    """A step on each server holding rows: a few rows of each table written (a sparse gradient),
    the dense tensors whole, as training does while a change copies ahead."""
    for s in servers:
        if s.empty:
            continue
        g = torch.Generator().manual_seed(seed * 10 + s.shard)
        grads = {}
        mine, _ = held(s.layout.plans["vocabulary"].global_ids(s.shard))     # as requests name them
        for name, p in zip(s.params.names, s.optimizer.params):
            if name in ROWS:
                rows = mine[torch.randperm(mine.numel(), generator=g)[:3]]
                grads[p] = torch.sparse_coo_tensor(rows[None], torch.randn(3, *p.shape[1:], generator=g), p.shape)
            else:
                grads[p] = torch.randn(p.shape, generator=g)
        s.optimizer.apply(grads)


@pytest.mark.parametrize("gridded", [True, False], ids=["gridded", "packed"])
def test_a_change_copied_ahead_while_rows_are_written_ends_with_every_write(gridded, monkeypatch):
    # Its 60 ids are too few for a grid (``GRID_DEPTH`` ids a slot): kept as one, and as they are.
    monkeypatch.setattr("ps.spec.sharding.GRID_DEPTH", 1 if gridded else 16)
    first = first_slots(model_spec(MODEL), 2)
    a, b, c = server("ps0", first), server("ps1", first), server("ps2", first)
    train([a, b], 1)
    seeds = iter(range(2, 100))
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    storage = {s.name: s.param("embedding.weight").data_ptr() for s in (a, b)}
    move([a, b, c], first, grown, meanwhile=lambda: train([a, b], next(seeds)))
    # What gave slots away kept its tensors, if gridded: the slots that stay were not copied.
    assert ({s.name: s.param("embedding.weight").data_ptr() for s in (a, b)} == storage) == gridded
    # The same writes on servers that never moved: what they hold, the moved hold, by id.
    x, y = server("ps0", first), server("ps1", first)
    for seed in range(1, next(seeds)):
        train([x, y], seed)
    expected = whole([x, y])
    after = whole([a, b, c])
    for name, (value, acc) in expected.items():
        assert torch.equal(after[name][0], value) and torch.equal(after[name][1], acc), name
    assert sorted(sum(s.info().tables.values()) for s in (a, b, c)) == [20, 20, 20]
    shrunk = grown.rebalanced(["ps0", "ps2"])          # and back, with writes meanwhile on all three
    before_back = {}

    def meanwhile():
        train([a, b, c], 50 + len(before_back))
        before_back.update(whole([a, b, c]))
    move([a, b, c], grown, shrunk, meanwhile=meanwhile)
    # ps0 took its slots back into the columns they left empty; ps2, full, was built again.
    assert (a.param("embedding.weight").data_ptr() == storage["ps0"]) == gridded
    assert int((a.layout.columns.slot_at < 0).sum()) == 0 and c.layout.columns is None
    after = whole([a, c])
    for name, (value, acc) in before_back.items():
        assert torch.equal(after[name][0], value) and torch.equal(after[name][1], acc), name
    assert sum(b.info().tables.values()) == 0


def test_what_a_lost_leaders_change_left_aside_is_not_used_by_the_next():
    first = first_slots(model_spec(MODEL), 2)
    a, b, c = server("ps0", first), server("ps1", first), server("ps2", first)
    train([a, b], 1)
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    lost = change_name(grown.epoch)
    take([a, b, c], first, grown, "early", lost)      # the leader was lost here, after the shards were built
    for s in (a, b, c):
        ShardMoves(s).prepare(grown.to_dict(), lost)
    train([a, b], 2)
    before = whole([a, b])
    other = first.rebalanced(["ps0", "ps2"])          # its successor's change: the same epoch, other owners
    assert other.epoch == grown.epoch and other != grown
    move([a, b, c], first, other)
    after = whole([a, c])
    for name, (value, acc) in before.items():
        assert torch.equal(after[name][0], value) and torch.equal(after[name][1], acc), name
    assert sum(b.info().tables.values()) == 0


@pytest.mark.parametrize("ahead", [False, True], ids=["all-held", "copied-ahead"])
def test_a_change_that_failed_half_way_leaves_nothing_its_next_attempt_uses(ahead):
    """A failed attempt and the next have the same epoch: what the first took from one source (it
    failed on the other) must not stand in for that source's part in the second."""
    first = first_slots(model_spec(MODEL), 2)
    a, b, c = server("ps0", first), server("ps1", first), server("ps2", first)
    train([a, b], 1)
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    take([a, b, c], first, grown, "all", change_name(grown.epoch), only=["ps0"])    # ps1 was lost here
    train([a, b], 2)
    before = whole([a, b])
    move([a, b, c], first, grown, meanwhile=(lambda: None) if ahead else None)
    after = whole([a, b, c])
    for name, (value, acc) in before.items():
        assert torch.equal(after[name][0], value) and torch.equal(after[name][1], acc), name
    assert sorted(sum(s.info().tables.values()) for s in (a, b, c)) == [20, 20, 20]


def test_an_early_part_taken_a_few_tables_at_a_time_moves_every_row_of_every_table(monkeypatch):
    from ps.server import precopy
    from trainer.ctr.config import CtrServerConfig
    from trainer.ctr.server import ctr_model
    spec = ctr_model(CtrServerConfig(scale=0.0005, dim=4, bottom="8", top="8", name="ps0", num_ps=2))
    monkeypatch.setattr(precopy, "PIECE_ROWS", 40)
    first = first_slots(spec, 2)
    layout = precopy.Layout.of(spec, first)
    pieces = by_rows(layout, 0)                     # several, each table in one of them
    assert len(pieces) > 3 and sorted(t for p in pieces for t in p) == sorted(precopy.plain_tables(layout))
    group = [ParameterServer(n, k, first, spec, PsMetrics(CollectorRegistry(), "ps", n))
             for k, n in enumerate(("ps0", "ps1", "ps2"))]

    before = rows_by_id(group[:2])
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    move(group, first, grown, meanwhile=lambda: None)
    after = rows_by_id(group)
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(s.layout.epoch == 2 and not s.empty for s in group)


def sighted(servers, ids):
    """``ids`` read once by a training step on the servers that own them; the ids admitted by it."""
    admitted = []
    for s in servers:
        mine = ids[s.layout.plans["t"].owner(ids) == s.shard]     # none on a server the layout does not name
        if mine.numel():
            _, read = s.hashed.lookup("t", "e.weight", mine, s.optimizer.steps)
            admitted += read.ids.tolist()        # the ids read have rows
    return sorted(admitted)


@pytest.mark.parametrize("ahead", [False, True], ids=["all-held", "copied-ahead"])
def test_an_id_seen_but_not_admitted_keeps_its_count_where_its_slot_moves(ahead):
    from ps.spec.model import Lifecycle
    from tests.unit.test_hashed_server import spec
    model = spec(40_000, Lifecycle(admit_after=3))     # a sketch of 5,000 counters a row: few collisions
    first = first_slots(model, 2)
    old = [ParameterServer(n, k, first, model, PsMetrics(CollectorRegistry(), "ps", n))
           for k, n in enumerate(("ps0", "ps1"))]
    third = ParameterServer("ps2", 2, first, model, PsMetrics(CollectorRegistry(), "ps", "ps2"))
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    ids = torch.arange(0, 600) * 7 + 3
    moving = ids[grown.owner_of[ids % grown.count] == 2]
    assert 0 < moving.numel() < ids.numel()
    early = sighted(old, ids) + sighted(old, ids)        # seen twice: a collision may admit one early
    assert len(early) < 5, early
    move([*old, third], first, grown, meanwhile=(lambda: None) if ahead else None)
    # The third sighting admits every id, on whichever server its slot is now: the counts came with
    # the slots to ps2, and stayed on the servers that were rebuilt.
    assert sighted([*old, third], ids) == sorted(ids.tolist())
    assert sorted(third.hashed.tables["t"].index.rows()[0].tolist()) == sorted(moving.tolist())


def test_a_table_kept_whole_moves_with_its_home_copied_ahead_into_a_server_that_fills():
    import torch.nn as nn

    import rpcps
    from ps.spec.sharding import table_unit
    from trainer.core.hosted import hosted_spec

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.tables = rpcps.EmbeddingBags([rpcps.TableConfig(name="item", rows=40, dim=4, placement="table_wise"),
                                               rpcps.TableConfig(name="genre", rows=30, dim=4)])
            self.top = nn.Linear(8, 1)
    spec = hosted_spec(Model(), optimizer="adagrad")
    first = first_slots(spec, 2)
    servers = [ParameterServer(n, k, first, spec, PsMetrics(CollectorRegistry(), "ps", n))
               for k, n in enumerate(("ps0", "ps1", "ps2"))]
    before = rows_by_id(servers[:2])
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    storage = servers[0].param("tables.weights.item").data_ptr()
    move(servers, first, grown, meanwhile=lambda: None)
    # It stays on its home, where it is: not copied.
    assert grown.servers[grown.home(table_unit("item"))] == "ps0"
    assert servers[0].param("tables.weights.item").data_ptr() == storage
    # Its home leaves: the table goes to ps1, which fills the columns it gave ps2.
    shrunk = grown.rebalanced(["ps1", "ps2"])
    move(servers, grown, shrunk, meanwhile=lambda: None)
    ps1 = servers[1]
    assert ps1.layout.plans["item"].rows(ps1.shard) == 40 and ps1.layout.columns is not None
    after = rows_by_id(servers[1:])
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
