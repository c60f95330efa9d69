"""One trainer's training step against the servers, for any server-hosted workload: wait for the
step clock, take a batch, fetch, compute the loss, finish (the step protocol is ``ps/client/session.py``'s
``StepSession``). What a batch is and how its loss is computed is the workload's ``Task``; no
HTTP, no process concerns."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol

import torch

from ps.client.cache import CacheCounts, HotRows
from ps.spec.messages import Mark
from services.errors import StepLost
from trainer.core.prefetch import Lookahead
from trainer.core.served import ServedModel


@dataclass
class StepResult:
    loss: float
    units: int                  # what the step trained on, in the task's unit (tokens, samples)
    seconds: float
    grad_norm: float
    phases: dict[str, float] = field(default_factory=dict)
    arrived_at: float = 0.0     # time.monotonic() when reported to the step clock (sync, ssp)
    rpc_bytes: int = 0          # tensor bytes to and from the servers (``ps.client.traffic.Traffic``)
    allreduce_bytes: int = 0    # bytes handed to the trainers' all-reduce (--dense allreduce)
    rpcs: int = 0               # messages to the servers: calls and distributed backward's gradients
    cache: Optional[CacheCounts] = None   # what the rows cache gave this step (its ``rows`` and ``max_age``: so far)
    cpu: dict[str, float] = field(default_factory=dict)   # the training thread's CPU seconds by metrics.CPU_PHASES


class _Moments:
    """A step's moments, each on the clock and on the training thread's CPU clock, and the
    phases between them."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        self.wall[name], self.cpu[name] = time.perf_counter(), time.thread_time()

    def phases(self, done: Any, waited: float) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds of each phase on the clock (``metrics.STEP_PHASES``), and of CPU
        (``metrics.CPU_PHASES``), of a step that waited ``waited`` at its clock and ended as
        ``done`` (a ``Finished``)."""
        w, c = self.wall, self.cpu
        phases = {"fetch": w["fetched"] - w["start"], "forward": w["forward"] - w["fetched"], "backward": done.backward,
                  "clip": done.clip, "optimize": done.optimize, "barrier": waited + done.barrier,
                  "total": w["end"] - w["start"] + waited}
        cpu = {"batch": c["start"] - c["begin"], "fetch": c["fetched"] - c["start"],
               "forward": c["forward"] - c["fetched"], "backward": done.backward_cpu,
               "update": c["end"] - c["forward"] - done.backward_cpu, "total": c["end"] - c["begin"]}
        return phases, cpu


class Task(Protocol):
    """What a workload's trainer computes, over a ``ServedModel``: its batches in order (its
    position in its data, which checkpoints save), a step's loss, and the held-out evaluation."""

    unit: str                   # what throughput counts: "tokens", "samples"
    # (optional) exactly_once: bool -- each batch goes with its position to the servers, which
    # apply it once and tell a replacement where to resume (``ps/server/marks.py``)
    model: ServedModel
    data: str                   # what it trains on, in words (saved with positions)

    def next_batch(self) -> Any:
        """The next training batch; the position moves past it."""

    def fetch(self, batch: Any) -> Any:
        """Inside the step's autograd context: what the step needs from the servers."""

    def loss(self, batch: Any, fetched: Any) -> torch.Tensor: ...

    def units(self, batch: Any) -> int: ...

    def stepped(self) -> None:
        """After a step (state carried from one batch to the next is detached here)."""

    def position(self, steps: int) -> dict[str, Any]:
        """What a checkpoint saves of where this trainer is, ``steps`` its steps so far (a task
        whose batches are read ahead also takes ``at``: where its data stood, ``tell()``, before
        the oldest batch not trained yet)."""

    def restore(self, saved: list[dict[str, Any]], checkpoint: str) -> int:
        """Move to where the saved positions (every trainer's, of ``checkpoint``) left this trainer;
        the steps it had taken (0: from the beginning)."""

    def evaluate(self, should_stop: Callable[[], bool], progress: Callable[[int, Optional[int]], None]
                 ) -> dict[str, Any]:
        """The held-out evaluation (no gradients, nothing changed): the status fields it gives."""


class TrainLoop:
    """``clip``: the global gradient-norm clip; ``slow_down``/``slow_fraction``: a straggler on
    purpose (``seed`` and ``name`` choose which steps); ``metrics``: a ``TrainerMetrics``."""

    def __init__(self, task: Task, clip: float, *, name: str = "", seed: int = 0, slow_down: float = 1.0,
                 slow_fraction: float = 1.0, metrics: Any = None, prefetch: int = 0,
                 cache: Optional[HotRows] = None) -> None:
        """``prefetch``: batches read ahead (``trainer/core/prefetch.py``); ``cache``: copies of the
        rows read most, kept on the trainer (``ps/client/cache.py``). ``ValueError`` if either
        is staler than the servers' consistency allows."""
        self.task, self.model, self.clip = task, task.model, clip
        self.slow_down, self.slow_fraction = slow_down, slow_fraction
        self.metrics = metrics
        self._slow = random.Random(f"{seed}/{name}")   # which steps --slow-fraction slows
        client = task.model.client
        client.read_ahead(prefetch, cache)
        self.lookahead: Optional[Lookahead] = None
        # Each batch's update says which it is, so each server applies it once (``ps/server/marks.py``):
        # a task opts in (``exactly_once``) when its position after a batch is small and whole.
        self.marks = bool(getattr(task, "exactly_once", False))
        self._again: Optional[tuple[Any, Mark]] = None     # a marked batch whose step was lost: trained next
        if prefetch:
            self.lookahead = Lookahead(task, client, prefetch, dense=task.model.replica is None)
        # With reads ahead, what a step moves is counted from the end of the step before: the
        # answers to the reads it issued for the next one may land between the two.
        self._moved_since: Optional[tuple[int, int, int]] = None

    @classmethod
    def of(cls, task: Task, cfg: Any, metrics: Any = None, prefetch: int = 0,
           cache: Optional[HotRows] = None) -> "TrainLoop":
        """From a trainer's settings (``trainer/core/config.py``), and how its workload reads."""
        return cls(task, cfg.clip, name=cfg.name, seed=cfg.seed, slow_down=cfg.slow_down,
                   slow_fraction=cfg.slow_fraction, metrics=metrics, prefetch=prefetch, cache=cache)

    def ready(self, wait: float) -> bool:
        """Whether the task has a batch for a step now, waiting up to ``wait`` seconds for one (a
        followed folder's next file; a task without ``ready`` always has one)."""
        ready = getattr(self.task, "ready", None)
        return True if ready is None else ready(wait)

    def position(self, steps: int) -> dict[str, Any]:
        """What a checkpoint saves of where this trainer is: before the batches read ahead."""
        if self.lookahead is None:
            return self.task.position(steps)
        return self.task.position(steps, at=self.lookahead.at())

    def idle(self) -> None:
        """No step follows soon (an episode ended): what was read ahead would be stale by then."""
        self._moved_since = None
        if self.lookahead is not None:
            self.lookahead.drop_reads()

    def _moved(self) -> tuple[int, int, int]:
        """What this trainer has moved so far: RPC bytes, all-reduce bytes, RPC messages."""
        return self.model.client.traffic.total, self.model.allreduce_bytes, self.model.client.traffic.calls

    def _take(self, steps: Optional[int]) -> tuple[Any, Any, Optional[Mark]]:
        """The step's batch (read ahead, or now) and its mark when the task opts in. A marked batch
        whose step was lost on its way (a server went away, a request refused as an old
        incarnation's) comes again under the same mark: a server that applied it before the loss
        does not apply it twice, and none misses it."""
        if self._again is not None:
            (batch, mark), self._again = self._again, None
            return None, batch, mark
        ahead = self.lookahead.next() if self.lookahead is not None else None
        batch = ahead.batch if ahead is not None else self.task.next_batch()
        mark = Mark(steps, self.task.units(batch), self.position(steps)) if steps is not None and self.marks else None
        return ahead, batch, mark

    def step(self, steps: Optional[int] = None) -> StepResult:
        """One step; ``steps``: this trainer's steps once it applies, which with where the data
        then stands marks its batch for the servers (``ps.spec.messages.Mark``)."""
        client = self.model.client
        # The step boundary: in sync and ssp modes, wait for the step clock before taking the batch.
        rpc_before, allreduce_before, calls_before = self._moved_since or self._moved()
        cached_before = replace(client.cache.counts) if client.cache is not None else None
        at = _Moments()
        at("begin")
        waited = client.clock.begin()
        self.model.follow_group()
        batch, mark = None, None
        try:
            ahead, batch, mark = self._take(steps)
            self.model.train()
            at("start")
            with client.step() as step:
                try:
                    fetched = self.task.fetch(batch) if ahead is None else self.lookahead.fetched(ahead, step)
                    at("fetched")
                    loss = self.task.loss(batch, fetched)
                    at("forward")
                    # Read ahead, the next step's dense weights come with this step's apply (async, ssp).
                    done = step.finish(loss, self.clip, self.model.replica,
                                       weights=self.lookahead is not None and self.lookahead.dense, mark=mark)
                except Exception as exc:
                    # Inside the step's context: ``failed`` holds its release until a lost server
                    # has left this process's view of the group (``PsClient.failed``).
                    lost = client.losses.failed(exc, self.model.replica)
                    if lost is None:
                        raise
                    raise lost from exc
        except BaseException as exc:
            self.idle()        # what was read ahead may predate the failure's consequences
            if mark is not None and isinstance(exc, StepLost):
                self._again = (batch, mark)
            raise
        if self.lookahead is not None:
            self.lookahead.applied(done.weights)
        at("end")
        self.task.stepped()
        if self.slow_down > 1.0 and self._slow.random() < self.slow_fraction:
            # A straggler on purpose: idle (N-1) times this step's own work (not its wait for others).
            time.sleep((self.slow_down - 1.0) * (at.wall["end"] - at.wall["start"] - done.barrier))
            at.wall["end"] = time.perf_counter()
        phases, cpu = at.phases(done, waited)
        if self.lookahead is not None:
            phases["fetch_hidden"] = self.lookahead.hidden
        rpc_now, allreduce_now, calls_now = moved = self._moved()
        if self.lookahead is not None:
            self._moved_since = moved
        result = StepResult(float(loss.detach()), self.task.units(batch), phases["total"], done.grad_norm, phases,
                            done.arrived_at, rpc_now - rpc_before, allreduce_now - allreduce_before,
                            calls_now - calls_before, cpu=cpu)
        if cached_before is not None:
            result.cache = client.cache.counts.since(cached_before, client.cache.rows)
        if self.metrics is not None:
            self.metrics.stepped(result)
        return result
