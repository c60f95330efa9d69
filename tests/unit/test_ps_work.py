"""A server's account of its work, and what a trainer's request carries."""
import threading

import torch

from ps.client.lookups import on_the_wire
from ps.client.stub import Traffic
from ps.server.work import Work


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
