"""Batches read ahead (``trainer/core/prefetch.py``), over a fake client and task: which reads go
out when in each consistency (the dense weights always once the step before is applied), for
which step, what a checkpoint's position says with batches taken and not trained, and reads
dropped after a failure going out again when their batch is due. And what each consistency lets
a trainer read ahead or keep (``PsClient.read_ahead``, which ``TrainLoop`` calls)."""
from types import SimpleNamespace

import pytest
import torch

from ps.client.cache import HotRows
from ps.client.client import PsClient
from ps.spec.consistency import Consistency
from trainer.core.loop import TrainLoop
from trainer.core.prefetch import Lookahead


class Reads:
    def __init__(self, batch):
        self.batch = batch

    def hidden(self):
        return 0.0


class FakeClient:
    read_ahead = PsClient.read_ahead      # the real rule of what a consistency lets a trainer read early

    def __init__(self, consistency):
        self.consistency = Consistency.parse(consistency)
        self.clock = SimpleNamespace(ahead=0)
        self.cache = None
        self.issued = []         # the batches whose reads went out, in order
        self.steps_on = {}       # batch -> for which step after the last one begun its rows were read
        self.routes = SimpleNamespace(pushable=self._pushable)

    @staticmethod
    def _pushable(lookups):
        early = {p: ids for p, ids in lookups.items() if not p.startswith("hashed")}
        return early, {p: ids for p, ids in lookups.items() if p not in early}

    def issue(self, lookups, dense, ahead=0):
        """A batch's rows are named by the batch; "w" is a read of the dense weights alone."""
        assert dense == (not lookups), "rows and dense weights are read apart"
        read = int(lookups["rows"][0]) if lookups else "w"
        self.issued.append(read)
        if lookups:
            self.steps_on[read] = ahead
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
    assert client.steps_on == {0: 1, 1: 2, 2: 3, 3: 3}, "each read for the step that will use it"


def test_dense_weights_answered_by_the_apply_are_the_next_steps_read():
    # async and ssp: the apply answers with the dense weights it left (StepSession.finish(...,
    # weights=True)); the next step adopts them, and no read of its own goes out for them.
    client, task = FakeClient("async"), FakeTask()
    ahead = Lookahead(task, client, 1, dense=True)
    ahead.next()
    answered = SimpleNamespace(hidden=lambda: 0.25)     # landed with the apply, long before the step
    ahead.applied(answered)
    assert client.issued == [0, "w", 1], "no read of the dense weights after the apply"
    ahead.next()
    assert client.issued == [0, "w", 1, 2] and ahead.hidden == 0.25, "the step waits on the apply's answer"


def test_sync_reads_the_next_batch_only_once_the_step_before_it_is_applied():
    client, task = FakeClient("sync"), FakeTask()
    ahead = Lookahead(task, client, 1, dense=True)
    assert ahead.next().batch == 0 and client.issued == [0, "w"]
    assert ahead.at() == 1, "nothing taken ahead yet"
    ahead.applied()
    assert client.issued == [0, "w", "w", 1] and ahead.at() == 1
    assert ahead.next().batch == 1 and client.issued == [0, "w", "w", 1]
    assert client.steps_on == {0: 1, 1: 1}, "batch 1 read after step 1 ended, for the next one"


def loop(consistency, prefetch=0, cache=None):
    client = FakeClient(consistency)
    task = FakeTask()
    task.model = SimpleNamespace(client=client, replica=None)
    TrainLoop(task, 0.0, prefetch=prefetch, cache=cache)
    return client


def test_each_consistency_allows_what_it_can_keep_to_and_the_clock_counts_the_rest():
    assert loop("async", 4, HotRows(10, 50)).clock.ahead == 0, "async has no step clock to tell"
    assert loop("ssp:3", 2, HotRows(10, 3)).clock.ahead == 3, "ssp: rows read ahead or kept count as steps ahead"
    assert loop("sync", 1, HotRows(10, 0)).cache is not None, "sync: read once the step before is applied"
    for consistency, prefetch, cache, refusal in [
            ("sync", 2, None, "only the next batch is read ahead: --prefetch 1"),
            ("sync", 0, HotRows(10, 1), "--cache-staleness 0"),
            ("ssp:2", 3, None, "staler than ssp:2 allows: 2 steps at most"),
            ("ssp:2", 1, HotRows(10, 3), r"rows 3 steps old \(--prefetch 1 and --cache-staleness 3\)"),
            ("ssp:0", 1, None, "ssp:0 reads every row in its step")]:
        with pytest.raises(ValueError, match=refusal):
            loop(consistency, prefetch, cache)


def test_reads_dropped_after_a_failure_go_out_again_when_their_batch_is_due():
    client, task = FakeClient("async"), FakeTask()
    ahead = Lookahead(task, client, 1, dense=False)      # the dense weights replicated here: none read
    ahead.next()
    ahead.drop_reads()                       # the step failed: batch 1's read may predate what followed
    assert ahead.at() == 1, "batch 1 is kept, untrained"
    second = ahead.next()
    assert second.batch == 1 and client.issued == [0, 1, 1, 2], "batch 1 read again, then batch 2 ahead"
