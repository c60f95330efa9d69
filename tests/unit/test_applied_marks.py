"""Each batch once on each server (``ps/server/marks.py``), without RPC: a server applies a
trainer's update only when its mark's steps are past the newest it holds of that trainer, keeps the
marks with its parameters through checkpoints (whole, delta, resharded), and a trainer started again
resumes after the oldest of the servers' marks of it (``trainer/core/position.py``'s ``resume_from``)."""
import functools

import torch
from prometheus_client import CollectorRegistry

from ps.server.delta import apply_delta
from ps.server.marks import AppliedMarks
from ps.server.metrics import PsMetrics
from ps.server.service import ParameterServer
from ps.spec.messages import Mark
from tests.unit.test_hashed_server import servers, spec
from trainer.core.position import resume_from


def mark(steps, records=10):
    return Mark(steps, records, {"name": "ctr1", "steps": steps, "file": "a.csv", "record": steps * records})


def apply(server, steps, trainer="ctr1"):
    """ctr1's batch of ``steps``: a gradient of ones on the dense tensor (where the server holds it)."""
    if "w" not in server.params.names:
        server.optimizer.apply({}, marks={trainer: mark(steps)})
        return None
    w = server.param("w")
    server.optimizer.apply({w: torch.ones_like(w)}, marks={trainer: mark(steps)})
    return w.detach().clone()


def test_a_batch_is_applied_once_and_its_repeat_is_answered_without_a_change():
    (server,) = servers(1, spec(8))
    for k in (1, 2, 3):
        apply(server, k)
    before = server.param("w").detach().clone()
    after = apply(server, 3)           # its predecessor's batch 3, trained again by a replacement
    assert torch.equal(before, after) and server.optimizer.steps == 3
    apply(server, 4)
    assert not torch.equal(server.param("w"), after) and server.optimizer.steps == 4
    apply(server, 1, trainer="ctr0")   # each trainer's own sequence
    status = server.optimizer.marks.status()
    assert status == {"trainers": {"ctr1": {"steps": 4, "records": 40}, "ctr0": {"steps": 1, "records": 10}},
                      "repeated": 1}, status
    assert server.optimizer.marks.of("ctr1")["position"]["record"] == 40 and server.optimizer.marks.of("ctr9") is None


def test_an_update_without_a_mark_is_applied_and_a_sync_step_records_every_participant():
    (server,) = servers(1, spec(8))
    w = server.param("w")
    server.optimizer.apply({w: torch.ones_like(w)})
    server.optimizer.apply({w: torch.ones_like(w)}, marks={"ctr0": mark(1), "ctr1": mark(1)})
    assert server.optimizer.steps == 2
    assert server.optimizer.marks.status()["trainers"] == {"ctr0": {"steps": 1, "records": 10},
                                                           "ctr1": {"steps": 1, "records": 10}}


def test_marks_go_with_whole_and_delta_checkpoints_and_a_reshard_keeps_the_oldest():
    model = spec(8)
    group = servers(2, model)
    for k in (1, 2):
        for s in group:
            apply(s, k)
    whole = [s.export_state() for s in group]
    for s in group:
        with s.optimizer.lock:
            s.params.touched.settle(True, s.optimizer.steps)
    apply(group[0], 3)                 # ctr1 died after ps0 applied its batch 3, before ps1 did
    delta = [s.export_state(since=s.params.touched.since) for s in group]
    assert all("delta" in d for d in delta)
    replayed = [functools.reduce(apply_delta, pair) for pair in zip(whole, delta)]
    own = [ParameterServer(f"ps{k}", k, 2, model, PsMetrics(CollectorRegistry(), "ps", f"ps{k}"),
                           restore=[replayed[k]]) for k in (0, 1)]      # the same shape: each its own file
    assert [s.optimizer.marks.of("ctr1")["steps"] for s in own] == [3, 2]
    (merged,) = servers(1, model, restore=replayed)
    assert merged.optimizer.marks.of("ctr1")["steps"] == 2, "resharded: the oldest, so nothing is skipped"


def test_a_replacement_resumes_after_the_oldest_mark_when_it_is_newer_than_the_checkpoint():
    saved = {"checkpoint": "step-40", "states": [{"name": "ctr0", "steps": 5}, {"name": "ctr1", "steps": 4}]}
    marks = [AppliedMarks(), AppliedMarks()]
    marks[0].record({"ctr1": mark(9)})
    marks[1].record({"ctr1": mark(8)})
    resumed = resume_from(saved, [m.of("ctr1") for m in marks], "ctr1")
    assert resumed["states"] == [{"name": "ctr0", "steps": 5}, mark(8).position]
    assert resumed["checkpoint"] == "step-40, then the servers' updates to step 8"
    assert resume_from(None, [m.of("ctr1") for m in marks], "ctr1")["states"] == [mark(8).position]
    # A server that holds none of it (restored from before its first batch): the checkpoint's.
    assert resume_from(saved, [marks[0].of("ctr1"), None], "ctr1") is saved
    # A checkpoint newer than the marks (they were restored with an older one): the checkpoint's.
    newer = {"checkpoint": "step-90", "states": [{"name": "ctr1", "steps": 12}]}
    assert resume_from(newer, [m.of("ctr1") for m in marks], "ctr1") is newer
    assert resume_from(saved, [], "ctr1") is saved
