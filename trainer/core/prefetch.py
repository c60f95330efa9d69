"""A trainer's next batches taken ahead of the steps that train them, their reads already on the
way (``--prefetch K``), so that a step finds its rows and dense weights waiting instead of asking
for them. What may be read early is the consistency's to say:

* async: the rows of the next K batches are read as a step begins, while it computes: a row may
  miss the updates of the K steps before the one that trains with it (this trainer's own too);
* ssp:S: the same with K <= S; the step clock counts the K steps read ahead as steps ahead, so no
  read is staler than the bound allows (``ps/leader/clock/pace.py``);
* sync: a step's rows are read the moment the step before it is applied everywhere (nothing can
  change them before the step), overlapping the step clock's round and the batch's preparation:
  the step computes exactly what it would have without the prefetch.

The dense weights, which every step changes, are read in every mode the moment the step before
is applied: as fresh as a step that reads them itself (in async and ssp the apply answers with
them, ``StepSession.finish(..., weights=True)``, so they cost no round of their own). A read's
answers are the step's own leaves: their gradients are pushed to the servers that sent them
(``StepSession.adopt`` in ``ps/client/session.py``). A hashed table's rows are read in the step
itself, as without prefetch (reading admits its ids, and its rows change hands).

Batches taken ahead are not trained yet: the position a checkpoint saves is the one before the
oldest of them. Reads are dropped (the batches kept, read again when due) whenever a step fails
or an episode ends, so nothing read before a failure or a pause is trained with."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from ps.client.client import PsClient
from ps.client.fetching import Fetching
from ps.client.session import StepSession


class AheadTask(Protocol):
    """What a task tells for its batches to be taken and read ahead (``trainer.core.loop.Task``'s)."""

    def next_batch(self) -> Any: ...

    def lookups(self, batch: Any) -> dict[str, torch.Tensor]:
        """The rows ``batch`` reads: table parameter -> ids."""

    def tell(self) -> Any:
        """Where the task's data stands, for ``position(steps, at=...)``."""


@dataclass
class Ahead:
    batch: Any
    at: Any                          # where the data stood before this batch
    early: dict[str, torch.Tensor]   # the lookups read ahead
    late: dict[str, torch.Tensor]    # the lookups read in the step's own context (hashed tables)
    reads: Optional[Fetching] = None


class Lookahead:
    """``depth`` batches read ahead of the step (sync: the next one, read once its step may
    begin); ``dense``: the step reads the servers' dense weights (no replica of them here)."""

    def __init__(self, task: AheadTask, client: PsClient, depth: int, dense: bool) -> None:
        """The consistency's word on ``depth`` is the caller's to have asked (``TrainLoop``)."""
        if depth < 1:
            raise ValueError(f"a prefetch reads 1 step ahead at least, not {depth}")
        self.task, self.client, self.dense = task, client, dense
        self.after_apply = client.consistency.averaged    # sync: rows read once the step before is applied
        self.depth = depth
        self.queue: deque[Ahead] = deque()
        self._weights: Optional[Fetching] = None     # the next step's dense weights, on their way
        self.hidden = 0.0          # seconds of the last step's reads that passed before it waited for them

    def next(self) -> Ahead:
        """The batch of the step beginning (its reads issued, if they were not), the reads of the
        batches after it issued as the consistency allows."""
        ahead = self.queue.popleft() if self.queue else self._take()
        self._issue(ahead, 1)
        if self.dense and self._weights is None:
            self._weights = self.client.issue({}, dense=True)
        if not self.after_apply:
            self._top_up(2)
        self.hidden = max(reads.hidden() for reads in (ahead.reads, self._weights) if reads is not None)
        return ahead

    def fetched(self, ahead: Ahead, step: StepSession) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Inside ``step``: what ``next`` gave read, adopted, with the rows a step reads itself."""
        rows, weights = step.adopt(ahead.reads)
        if self._weights is not None:
            weights = step.adopt(self._weights)[1]
            self._weights = None
        if ahead.late:
            rows.update(step.fetch(ahead.late, dense=False)[0])
        return rows, weights

    def applied(self, weights: Optional[Fetching] = None) -> None:
        """The step ended, applied (sync: everywhere): the next step's dense weights may be read,
        and in sync its rows. ``weights``: the dense weights the apply answered with (async and
        ssp: ``StepSession.finish(..., weights=True)``), read with it instead of after it."""
        if self.dense:
            self._weights = weights if weights is not None else self.client.issue({}, dense=True)
        if self.after_apply:
            self._top_up(1)

    def drop_reads(self) -> None:
        """Forget every read on its way (a step failed, an episode ended): the batches stay, and are
        read again when due."""
        self._weights = None
        for ahead in self.queue:
            ahead.reads = None

    def at(self) -> Any:
        """Where the data stands for a checkpoint: before the oldest batch taken and not trained."""
        return self.queue[0].at if self.queue else self.task.tell()

    def _take(self) -> Ahead:
        at = self.task.tell()
        batch = self.task.next_batch()
        early, late = self.client.routes.pushable(self.task.lookups(batch))
        return Ahead(batch, at, early, late)

    def _top_up(self, first: int) -> None:
        """The queue full, each batch's reads on their way: the first's for the ``first`` step
        after the last one begun."""
        while len(self.queue) < self.depth:
            self.queue.append(self._take())
        for k, ahead in enumerate(self.queue):
            self._issue(ahead, first + k)

    def _issue(self, ahead: Ahead, steps_on: int) -> None:
        """``ahead``'s reads, for the step ``steps_on`` after the last one begun."""
        if ahead.reads is None:
            ahead.reads = self.client.issue(ahead.early, dense=False, ahead=steps_on)
