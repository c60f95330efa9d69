import torch
import torch.nn.functional as F
import pytest

from ps.spec.sharding import ShardPlan, WholePlan, from_placement, placement_of, plan_of
from trainer.lm.softmax import DecoderShard, combine_partials


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
@pytest.mark.parametrize("placement", ["row_wise", "table_wise"])
def test_plan_partitions_every_id_exactly_once(shards, placement):
    plan = plan_of(placement, shards, 23, 7)
    assert from_placement(placement_of(plan), shards, 23) == plan
    assert sum(plan.rows(k) for k in range(shards)) == 23
    owned = torch.cat([plan.global_ids(k) for k in range(shards)])
    assert sorted(owned.tolist()) == list(range(23))
    ids = torch.tensor([0, 4, 7, 22, 13])
    parts = plan.partition(ids)
    assert sorted(torch.cat([p for p, _ in parts]).tolist()) == list(range(5))
    for k, (pos, g) in enumerate(parts):
        assert bool((plan.owner(g) == k).all()) and torch.equal(ids[pos], g)


def test_a_row_wise_plan_refuses_more_shards_than_rows_and_a_small_table_goes_whole():
    with pytest.raises(ValueError):
        ShardPlan(4, 3)
    assert isinstance(plan_of("", 4, 3, 5), WholePlan) and plan_of("", 4, 3, 5).home == 1
    assert isinstance(plan_of("", 4, 4, 5), ShardPlan)
    with pytest.raises(ValueError, match="unknown placement 'column_wise'"):
        plan_of("column_wise", 2, 10, 0)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_softmax_partials_equal_cross_entropy_and_its_gradients(shards):
    torch.manual_seed(0)
    ntoken, nhid, n = 11, 6, 9
    plan = ShardPlan(shards, ntoken)
    w, b = torch.randn(ntoken, nhid), torch.randn(ntoken)
    h = torch.randn(n, nhid, requires_grad=True)
    targets = torch.randint(0, ntoken, (n,))

    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref_h = h.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(ref_h, ref_w, ref_b), targets)
    ref.backward()

    decoders = [DecoderShard(w[plan.global_ids(k)].clone(), b[plan.global_ids(k)].clone()) for k in range(shards)]
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
    for k, d in enumerate(decoders):
        assert torch.allclose(d.weight.grad, ref_w.grad[plan.global_ids(k)], atol=1e-6)
        assert torch.allclose(d.bias.grad, ref_b.grad[plan.global_ids(k)], atol=1e-6)


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
