import torch
import torch.nn.functional as F
import pytest


from ps.spec.model import DenseGroup, Lifecycle, ModelSpec, Table
from ps.spec.sharding import (MIN_SLOTS, NO_ID, Columns, HashedPlan, Layout, ShardPlan, Slots, WholePlan,
                              client_plans, placement_of, resumed_slots)
from trainer.lm.softmax import DecoderShard, combine_partials


def _spec(placement="", rows=23, hashed=False):
    return ModelSpec({"t": Table(rows, {"t.weight": (2,)}, dict, placement=placement,
                                 hashed=Lifecycle() if hashed else None)},
                     (DenseGroup({"w": (3,)}, dict), DenseGroup({"v": (1,)}, dict)))


def _partitions_every_id_once(plan, shards, ids):
    parts = plan.partition(ids)
    assert sorted(torch.cat([p for p, _ in parts]).tolist()) == list(range(ids.numel()))
    for k, (pos, g) in enumerate(parts):
        assert bool((plan.owner(g) == k).all()) and torch.equal(ids[pos], g)


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
@pytest.mark.parametrize("placement", ["row_wise", "table_wise"])
def test_plan_partitions_every_id_exactly_once(shards, placement):
    layout = Layout.of(_spec(placement), shards)
    plan = layout.plans["t"]
    assert client_plans(layout.slots, {"t": placement_of(plan)}, {"t": 23})["t"] == plan
    assert sum(plan.held(k) for k in range(shards)) == 23
    owned = torch.cat([plan.global_ids(k) for k in range(shards)])
    assert sorted(owned[owned != NO_ID].tolist()) == list(range(23))
    _partitions_every_id_once(plan, shards, torch.tensor([0, 4, 7, 22, 13]))


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_the_first_layout_places_every_id_where_id_mod_n_did(shards):
    """So a checkpoint taken before slots restores as it was saved."""
    plan = Layout.of(_spec(rows=10_007), shards).plans["t"]
    assert plan.slots.count % shards == 0 and plan.slots.count >= MIN_SLOTS
    for k in range(shards):
        ids = plan.global_ids(k)
        # its ids rising, then the rows of its last column past the table's end
        assert torch.equal(ids[:plan.held(k)], torch.arange(k, 10_007, shards))
        assert bool((ids[plan.held(k):] == NO_ID).all()) and ids.numel() - plan.held(k) < plan.slots.count
        assert torch.equal(plan.to_local(ids[:plan.held(k)]), ids[:plan.held(k)] // shards)


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (1, 4), (4, 3), (3, 5)])
def test_a_change_of_servers_moves_a_share_of_the_slots_and_rows_stay_in_order(old, new):
    first = Slots.even(old)
    names = [f"ps{k}" for k in range(new)] if new > old else [f"ps{k}" for k in range(old) if k != 1][:new]
    after = first.rebalanced(names)
    assert after.epoch == first.epoch + 1 and after.servers == tuple(names)
    moved = [m for m in first.moves(after) if m.what.startswith("slot:")]
    # The fewest that can move: each server gives up only what it holds past its new share.
    held = {n: int(first.owned[k]) for k, n in enumerate(first.servers)}
    share = {n: int(after.owned[k]) for k, n in enumerate(after.servers)}
    assert len(moved) == sum(max(0, held[n] - share.get(n, 0)) for n in held)
    assert int(after.owned.max()) - int(after.owned.min()) <= 1
    plan = ShardPlan(after, 9_999)
    for k in range(new):
        ids = plan.global_ids(k)
        rows = (ids != NO_ID).nonzero().squeeze(1)
        ids = ids[rows]
        assert bool((ids[1:] > ids[:-1]).all()) and bool((plan.owner(ids) == k).all())
        assert torch.equal(plan.to_local(ids), rows) and ids.numel() == plan.held(k)
    _partitions_every_id_once(plan, new, torch.randperm(9_999)[:500])


def test_a_servers_columns_keep_what_stays_where_it_was_and_fill_the_empty_ones():
    first = Slots.even(2)
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    back = grown.rebalanced(["ps0", "ps1"])
    was = Columns.first(first, 0)
    assert was.width == 2048 and was.of[:4] == (0, -1, 1, -1)
    given = was.after(grown, 0)                    # slots leave: their columns are left empty
    stay = (grown.owner_of == 0).nonzero().squeeze(1)
    assert given.width == was.width and torch.equal(given.column_of[stay], was.column_of[stay])
    assert int((given.column_of >= 0).sum()) == int(grown.owned[0]) and int((given.slot_at < 0).sum()) == 2048 - int(grown.owned[0])
    taken = given.after(back, 0)                   # slots come: they fill the empty columns
    assert taken.width == was.width and int((taken.slot_at < 0).sum()) == 0
    assert torch.equal(taken.column_of[stay], was.column_of[stay])
    assert sorted(taken.column_of[back.owner_of == 0].tolist()) == list(range(2048))
    assert Columns.first(first, 0).after(Slots.even(2).rebalanced(["ps0"]), 0) is None    # more than fit
    # A table by those columns: each id in one row, what stayed where it was, the rest of no id.
    before, after = ShardPlan(first, 99_999, was), ShardPlan(back, 99_999, taken)
    assert before.gridded and before.depth == 25
    ids = torch.arange(99_999)
    mine = ids[after.owner(ids) == 0]
    assert before.rows(0) == after.rows(0) == before.depth * 2048
    assert torch.equal(after.ids_at(0, after.to_local(mine)), mine)
    kept = ids[(before.owner(ids) == 0) & (after.owner(ids) == 0)]
    assert torch.equal(before.to_local(kept), after.to_local(kept))
    held = after.global_ids(0)
    assert sorted(held[held != NO_ID].tolist()) == mine.tolist()
    # A small table is packed, whatever the columns: its ids rising, no row without one.
    small = ShardPlan(back, 9_999, taken)
    assert not small.gridded and small.rows(0) == small.held(0)
    assert torch.equal(small.global_ids(0), ShardPlan(back, 9_999).global_ids(0))
    assert torch.equal(small.to_local(small.global_ids(0)), torch.arange(small.rows(0)))


def test_adding_one_server_moves_about_one_in_n_plus_one_of_the_rows():
    first = Slots.even(2)
    after = first.rebalanced(["ps0", "ps1", "ps2"])
    before_plan, after_plan = ShardPlan(first, 100_000), ShardPlan(after, 100_000)
    ids = torch.arange(100_000)
    moved = int((before_plan.owner(ids) != after_plan.owner(ids)).sum())
    assert abs(moved / 100_000 - 1 / 3) < 0.01         # id % 3 would move two thirds


def test_a_unit_kept_whole_moves_only_when_its_server_leaves():
    layout = Layout.of(_spec(), 3)
    slots = layout.slots
    assert [layout.group_owner(g) for g in range(2)] == [0, 1]
    grown = slots.rebalanced(["ps0", "ps1", "ps2", "ps3"])
    assert [m.what for m in slots.moves(grown) if not m.what.startswith("slot:")] == []
    shrunk = slots.rebalanced(["ps0", "ps2"])
    units = {m.what: (m.source, m.destination) for m in slots.moves(shrunk) if not m.what.startswith("slot:")}
    assert units == {"dense:1": ("ps1", "ps2")}
    assert Slots.from_dict(shrunk.to_dict()) == shrunk


def test_a_layout_refuses_what_is_not_a_layout():
    with pytest.raises(ValueError, match="epoch starts at 1"):
        Slots(0, ("ps0",), (0,))
    with pytest.raises(ValueError, match="each of its servers once"):
        Slots(1, ("ps0", "ps0"), (0, 1))
    with pytest.raises(ValueError, match="among its 1 servers"):
        Slots(1, ("ps0",), (0, 1))
    with pytest.raises(ValueError, match="slot count is fixed"):
        Slots.even(2, 8).moves(Slots.even(2, 10))
    with pytest.raises(KeyError, match="ps9 holds no part of layout 1"):
        Slots.even(2).index("ps9")


def test_a_small_table_goes_whole_and_an_unknown_placement_is_refused():
    layout = Layout.of(_spec(rows=3), 4)
    assert isinstance(layout.plans["t"], WholePlan) and layout.plans["t"].home == 0
    assert isinstance(Layout.of(_spec(rows=4), 4).plans["t"], ShardPlan)
    assert isinstance(Layout.of(_spec(rows=4, hashed=True), 8).plans["t"], HashedPlan)
    with pytest.raises(ValueError, match="unknown placement 'column_wise'"):
        Layout.of(_spec("column_wise"), 2)


def test_a_job_restarted_on_other_servers_moves_its_checkpoints_layout():
    spec = _spec(rows=50)
    saved = Layout.of(spec, 2).slots
    assert resumed_slots(spec, ["ps0", "ps1"], None) == saved
    assert resumed_slots(spec, ["ps0", "ps1"], saved.to_dict()) == saved
    moved = resumed_slots(spec, ["ps0", "ps1", "ps2"], saved.to_dict())
    assert moved.epoch == 2 and moved.count == saved.count and len(saved.moves(moved)) == saved.count // 3


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_softmax_partials_equal_cross_entropy_and_its_gradients(shards):
    torch.manual_seed(0)
    ntoken, nhid, n = 11, 6, 9
    plan = ShardPlan(Slots.even(shards), ntoken)
    w, b = torch.randn(ntoken, nhid), torch.randn(ntoken)
    h = torch.randn(n, nhid, requires_grad=True)
    targets = torch.randint(0, ntoken, (n,))

    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref_h = h.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(ref_h, ref_w, ref_b), targets)
    ref.backward()

    # A shard's rows of no id are -inf logits, as the server's decode makes them.
    rows = [plan.global_ids(k) for k in range(shards)]
    decoders = [DecoderShard(w[ids.clamp(min=0)].clone(), b[ids.clamp(min=0)].masked_fill(ids == NO_ID, float("-inf")))
                for ids in rows]
    lse, tgt = [], []
    for k, d in enumerate(decoders):
        owned = plan.owner(targets) == k
        local = torch.where(owned, plan.to_local(targets), torch.zeros_like(targets))
        a, t = d.partials(h, local, owned.float(), d.weight.detach().clone(), d.bias.detach().clone())
        lse.append(a)
        tgt.append(t)
    loss = combine_partials(lse, tgt)
    loss.backward()

    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(h.grad, ref_h.grad, atol=1e-6)
    for ids, d in zip(rows, decoders):
        word = ids != NO_ID
        assert torch.allclose(d.weight.grad[word], ref_w.grad[ids[word]], atol=1e-6)
        assert torch.allclose(d.bias.grad[word], ref_b.grad[ids[word]], atol=1e-6)
        assert not d.weight.grad[~word].any() and not d.bias.grad[~word].any()     # no word: no gradient


def test_buffer_pool_reuses_by_size_and_never_hands_out_one_buffer_twice():
    from ps.server.tables import BufferPool

    pool = BufferPool(keep=2)
    a, b = pool.take(10, 10), pool.take(25, 10)
    pool.give(a)
    pool.give(b)
    c = pool.take(5, 10)                      # the smallest that fits: a's storage
    d = pool.take(20, 10)                     # b's
    assert c.data_ptr() == a.data_ptr() and d.data_ptr() == b.data_ptr()
    e = pool.take(5, 10)                      # none free: a new one
    assert e.data_ptr() not in (c.data_ptr(), d.data_ptr())


def test_a_table_smaller_than_the_slot_count_spreads_over_every_server_after_a_change():
    first = Slots.even(2)
    grown = first.rebalanced(["ps0", "ps1", "ps2"])
    shrunk = grown.rebalanced(["ps0", "ps2"])
    for slots, rows in ((grown, [11, 11, 11]), (shrunk, [16, 17])):
        plan = ShardPlan(slots, 33)
        assert sorted(plan.held(k) for k in range(slots.num_shards)) == sorted(rows)


def test_a_leader_started_again_after_a_change_starts_from_the_layout_it_kept(tmp_path):
    from pathlib import Path

    from ps.leader import layout
    from services.checkpoint.store import CheckpointInfo
    spec = _spec(rows=50)
    saved = Layout.of(spec, 2).slots                                   # what the newest checkpoint holds
    grown = saved.rebalanced(["ps0", "ps1", "ps2"])                    # a change adopted after it
    layout.record(tmp_path, grown)
    assert layout.recorded(tmp_path) == grown.to_dict()
    three = ["ps0", "ps1", "ps2"]

    def info(files):
        return CheckpointInfo(7, Path("step-7"), 0.0, {f: None for f in files}, {"layout": saved.to_dict()})
    shared = info(["ps0.pt", "ps1.pt"])
    assert layout.Choice(spec, three, kept=layout.recorded(tmp_path)).of(shared) == grown
    # a volume per server: the checkpoint's own layout, which each server's own file matches
    alone = info(["ps0.pt"])
    assert layout.Choice(spec, three, kept=grown.to_dict()).of(alone) == resumed_slots(spec, three, saved.to_dict())
    # a kept layout no newer than the checkpoint's, or of another slot count, is not this chain's
    assert layout.Choice(spec, ["ps0", "ps1"], kept=saved.to_dict()).of(shared) == saved
    other = Slots.even(2, saved.count * 2).rebalanced(three)
    assert layout.Choice(spec, three, kept=other.to_dict()).of(shared) == resumed_slots(spec, three, saved.to_dict())
    assert layout.Choice(spec, three, kept=grown.to_dict()).of(None) == resumed_slots(spec, three, None)
    layout.forget(tmp_path)
    assert layout.recorded(tmp_path) is None
    (tmp_path / layout.LAYOUT_FILE).write_text("{not json")
    assert layout.recorded(tmp_path) is None


def test_a_lost_leader_started_again_gives_the_job_back_on_the_servers_it_had(tmp_path):
    from pathlib import Path

    from ps.leader import layout
    from services.checkpoint.handover import LIFE_FILE
    from services.checkpoint.store import CheckpointInfo
    spec = _spec(rows=50)
    saved = Layout.of(spec, 2).slots
    grown = saved.rebalanced(["ps0", "ps1", "ps2"])
    layout.record(tmp_path, grown)
    newest = CheckpointInfo(7, Path("step-7"), 0.0, {"ps0.pt": None, "ps1.pt": None}, {"layout": saved.to_dict()})
    (tmp_path / LIFE_FILE).write_text("{}")              # the last leader did not stop cleanly
    assert layout.choice(spec, ["ps0", "ps1"], None, tmp_path).of(newest) == grown
    (tmp_path / LIFE_FILE).unlink()                      # a stop and a start: the count asked for
    assert layout.choice(spec, ["ps0", "ps1"], None, tmp_path).of(newest) == grown.rebalanced(["ps0", "ps1"])
