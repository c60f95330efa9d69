"""A server's account of its work, what an update answers with, what a trainer's request
carries, and which servers a trainer works with."""
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from ps.client.lookups import on_the_wire
from ps.client.losses import check_server
from ps.client.traffic import Traffic
from ps.server.update import SharedOptimizer
from ps.server.work import Work
from ps.spec.messages import ShardInfo
from ps.spec.rules import rule
from services.errors import PeerUnavailable


def test_work_adds_rows_and_seconds_from_many_threads():
    work = Work()
    threads = [threading.Thread(target=lambda: [work.add("lookup", 10, 0.001) for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    work.add("update", 30, 0.5)
    seen = work.describe()
    assert seen["lookup"]["rows"] == 40_000 and abs(seen["lookup"]["seconds"] - 4.0) < 1e-6
    assert abs(seen["lookup"]["rows_per_s"] - 10_000) < 1e-3
    assert seen["update"]["rows_per_s"] == 60.0


def test_an_idle_server_reports_no_rate():
    assert Work().describe()["update"] == {"rows": 0, "seconds": 0.0, "rows_per_s": 0.0}


def test_an_update_answers_with_what_it_left_before_any_other_update():
    w = torch.nn.Parameter(torch.zeros(2))
    optimizer = SharedOptimizer([w], [rule("sgd")], lr=1.0)
    before, (held, left) = optimizer.apply({w: torch.ones(2)},
                                           then=lambda: (optimizer.lock.locked(), w.detach().clone()))
    assert before == 0 and held, "read under the update's own hold of the lock"
    assert torch.equal(left, -torch.ones(2))
    assert optimizer.apply({w: torch.ones(2)}) == (1, None), "nothing asked, nothing read"


def test_ids_travel_as_int32_unless_the_table_needs_more():
    ids = torch.tensor([0, 5, 2**31 - 2])
    assert on_the_wire(ids, 2**31 - 1).dtype == torch.int32
    assert torch.equal(on_the_wire(ids, 2**31 - 1).long(), ids)
    assert on_the_wire(ids, 2**31).dtype == torch.int64


def test_traffic_counts_calls_and_the_gradient_messages_their_answers_bring():
    traffic = Traffic()
    with_grads = torch.futures.Future()
    traffic.call((torch.zeros(4, dtype=torch.int32),), with_grads, True)
    with_grads.set_result({"rows": torch.zeros(4, 16, requires_grad=True)})
    plain = torch.futures.Future()
    traffic.call((), plain, True)
    plain.set_result(1.5)
    assert traffic.calls == 3                       # two calls and one backward message
    assert traffic.total == 16 + 2 * 4 * 16 * 4     # the ids, the rows and their gradients
    ahead = torch.futures.Future()                  # a prefetch: outside a step, no way back
    traffic.call((torch.zeros(4, dtype=torch.int32),), ahead, False)
    ahead.set_result({"rows": torch.zeros(4, 16, requires_grad=True)})
    assert traffic.calls == 4
    assert traffic.total == 2 * (16 + 2 * 4 * 16 * 4) - 4 * 16 * 4


def test_a_trainer_refuses_servers_that_disagree_on_the_job_or_run_an_older_version():
    first = ShardInfo("ps0", 0, 2, {"kind": "ctr"}, {"C1": 5}, {"C1": ("tables.C1",)}, (), consistency="sync",
                      row_shapes={"tables.C1": (16,)})
    names = ["ps0", "ps1"]
    second = dataclasses.replace(first, name="ps1", shard=1)
    check_server(names, 1, second, first, 1)                    # the same job: accepted
    older = SimpleNamespace(**{f.name: getattr(second, f.name) for f in dataclasses.fields(second)
                               if f.name != "row_shapes"})     # what an older server's answer unpickles to
    for info, why in [(dataclasses.replace(second, shard=0), "serves shard 0 of 2, expected shard 1"),
                      (dataclasses.replace(second, model={"kind": "lm"}), "a different model"),
                      (dataclasses.replace(second, consistency="async"), "the same --consistency"),
                      (dataclasses.replace(second, row_shapes={}), "an older rpcps"),
                      (older, "an older rpcps than this trainer")]:
        with pytest.raises(PeerUnavailable, match=why):
            check_server(names, 1, info, first, 1)
