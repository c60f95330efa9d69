"""Batches read ahead (``trainer/core/prefetch.py``), over a fake client and task: which reads go
out when in each consistency (the dense weights always once the step before is applied), what a
checkpoint's position says with batches taken and not trained, and reads dropped after a failure
going out again when their batch is due."""
import pytest
import torch

from ps.spec.consistency import Consistency
from trainer.core.prefetch import Lookahead


class Reads:
    def __init__(self, batch):
        self.batch = batch

    def hidden(self):
        return 0.0


class FakeClient:
    def __init__(self, consistency):
        self.consistency = Consistency.parse(consistency)
        self.ahead = 0
        self.issued = []         # the batches whose reads went out, in order

    def ahead_of_step(self, lookups):
        early = {p: ids for p, ids in lookups.items() if not p.startswith("hashed")}
        return early, {p: ids for p, ids in lookups.items() if p not in early}

    def issue(self, lookups, dense):
        """A batch's rows are named by the batch; "w" is a read of the dense weights alone."""
        assert dense == (not lookups), "rows and dense weights are read apart"
        read = int(lookups["rows"][0]) if lookups else "w"
        self.issued.append(read)
        return Reads(read)


class FakeTask:
    """Batch ``k`` is the ``k``-th taken; the data stands at the batches taken so far."""

    def __init__(self):
        self.cursor = 0

    def next_batch(self):
        self.cursor += 1
        return self.cursor - 1

    def lookups(self, batch):
        return {"rows": torch.tensor([batch]), "hashed.rows": torch.tensor([7])}

    def tell(self):
        return self.cursor


def test_async_reads_the_next_batches_while_a_step_computes_and_saves_the_position_before_them():
    client, task = FakeClient("async"), FakeTask()
    ahead = Lookahead(task, client, 2, dense=True)
    first = ahead.next()
    assert first.batch == 0 and first.reads.batch == 0
    assert client.issued == [0, "w", 1, 2], "the step's own reads, then the rows of the two batches after it"
    assert first.late == {"hashed.rows": torch.tensor([7])}, "a hashed table's rows are read in the step"
    assert ahead.at() == 1, "batches 1 and 2 are taken, not trained: a checkpoint resumes before them"
    ahead.applied()
    assert client.issued[-1] == "w", "the next step's dense weights, read once this step is applied"
    assert ahead.next().batch == 1 and client.issued == [0, "w", 1, 2, "w", 3]
    assert client.ahead == 0, "async has no step clock to tell"


def test_sync_reads_the_next_batch_only_once_the_step_before_it_is_applied():
    client, task = FakeClient("sync"), FakeTask()
    ahead = Lookahead(task, client, 1, dense=True)
    assert ahead.next().batch == 0 and client.issued == [0, "w"]
    assert ahead.at() == 1, "nothing taken ahead yet"
    ahead.applied()
    assert client.issued == [0, "w", "w", 1] and ahead.at() == 1
    assert ahead.next().batch == 1 and client.issued == [0, "w", "w", 1]
    with pytest.raises(ValueError, match="--prefetch 1"):
        Lookahead(task, client, 2, dense=True)


def test_ssp_tells_the_clock_how_far_ahead_its_steps_read_and_refuses_more_than_the_bound():
    client = FakeClient("ssp:2")
    Lookahead(FakeTask(), client, 2, dense=True)
    assert client.ahead == 2
    with pytest.raises(ValueError, match="staler than ssp:2"):
        Lookahead(FakeTask(), FakeClient("ssp:2"), 3, dense=True)
    with pytest.raises(ValueError, match="no --prefetch in ssp:0"):
        Lookahead(FakeTask(), FakeClient("ssp:0"), 1, dense=True)


def test_reads_dropped_after_a_failure_go_out_again_when_their_batch_is_due():
    client, task = FakeClient("async"), FakeTask()
    ahead = Lookahead(task, client, 1, dense=False)      # the dense weights replicated here: none read
    ahead.next()
    ahead.drop_reads()                       # the step failed: batch 1's read may predate what followed
    assert ahead.at() == 1, "batch 1 is kept, untrained"
    second = ahead.next()
    assert second.batch == 1 and client.issued == [0, 1, 1, 2], "batch 1 read again, then batch 2 ahead"
