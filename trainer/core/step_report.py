"""What a trainer's status says of its steps (``StepReport``): the loss, its recent average and its
first value, units a second past the warm-up, where a step's time went and what it moved, and,
where they are on, the replica's digests and what the row cache gave."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ps.client.cache import CacheCounts
from trainer.core.loop import StepResult


@dataclass
class _Throughput:
    """An episode's units (tokens, samples) a second, its first steps (``warmup``) left out: they
    pay connection set-up and allocation. ``window`` is wall-clock, so ``rpcps up`` can add up
    trainers' windows; it names its count by the unit."""

    warmup: int
    unit: str
    units: int = 0
    seconds: float = 0.0
    start: Optional[float] = None
    end: Optional[float] = None

    def add(self, step: int, result: StepResult, started: float) -> float:
        if step > self.warmup:
            self.units += result.units
            self.seconds += result.seconds
            self.start, self.end = self.start or started, time.time()
        return self.units / self.seconds if self.seconds else result.units / result.seconds

    @property
    def window(self) -> dict[str, Any]:
        return {self.unit: self.units, "start": self.start, "end": self.end}


class StepReport:
    """The status fields after each step: per episode (``new_episode``) the loss and throughput,
    across episodes the traffic and the cache's counts. ``replica``: the trainers' replica of the
    weights they all-reduce, or None."""

    def __init__(self, warmup: int, unit: str, replica: Callable[[], Any]) -> None:
        self.warmup, self.unit, self._replica = warmup, unit, replica
        self._traffic: dict[str, Any] = {"steps": 0, "rpc_bytes": 0, "rpcs": 0, "allreduce_bytes": 0,
                                         "bytes_saved": 0, "timed_steps": 0, "phase_seconds": {}, "phase_cpu_seconds": {}}
        self._cache = CacheCounts()        # --cache-rows: what the copies gave, over every step so far
        self._digests: deque[tuple[int, str]] = deque(maxlen=128)   # --dense allreduce: the replica's last steps
        self.new_episode()

    def new_episode(self) -> None:
        self._recent: deque[float] = deque(maxlen=20)
        self._first_loss: Optional[float] = None
        self._throughput = _Throughput(self.warmup, self.unit)
        self.per_s = 0.0

    @property
    def loss_avg(self) -> float:
        return sum(self._recent) / len(self._recent)

    def add(self, step: int, result: StepResult, started: float) -> dict[str, Any]:
        """The status fields after the episode's ``step``-th step, ``result``, begun at ``started``
        (``time.time()``)."""
        self._first_loss = result.loss if self._first_loss is None else self._first_loss
        self._recent.append(result.loss)
        self.per_s = self._throughput.add(step, result, started)
        return {"loss": result.loss, "loss_avg": self.loss_avg, "loss_first": self._first_loss,
                f"{self.unit}_per_s": self.per_s, "grad_norm": result.grad_norm, "timed": self._throughput.window,
                "step_seconds": {k: round(v, 6) for k, v in result.phases.items()},
                "step_cpu_seconds": {k: round(v, 6) for k, v in result.cpu.items()},
                "moved": self._count_traffic(result, step > self.warmup),
                **self._replica_status(), **self._cache_status(result)}

    def _count_traffic(self, result: StepResult, timed: bool) -> dict[str, Any]:
        """``timed``: past the warm-up steps, whose set-up costs would blur where a step's time goes."""
        t = self._traffic
        t["steps"] += 1
        t["rpc_bytes"] += result.rpc_bytes
        t["rpcs"] += result.rpcs
        t["allreduce_bytes"] += result.allreduce_bytes
        t["bytes_saved"] += result.cache.saved if result.cache is not None else 0
        if timed:
            t["timed_steps"] += 1
            for key, by_phase in (("phase_seconds", result.phases), ("phase_cpu_seconds", result.cpu)):
                for phase, seconds in by_phase.items():
                    t[key][phase] = t[key].get(phase, 0.0) + seconds
        return {**t, **{key: {k: round(v, 6) for k, v in t[key].items()}
                        for key in ("phase_seconds", "phase_cpu_seconds")}}

    def _cache_status(self, result: StepResult) -> dict[str, Any]:
        """--cache-rows: what the trainer's copies of rows gave, so far."""
        step = result.cache
        if step is None:
            return {}
        c = self._cache
        c.add(step)
        asked = c.hits + c.misses
        return {"cache": {"hits": c.hits, "misses": c.misses, "bytes_saved": c.saved, "lookups": c.lookups,
                          "rows": c.rows, "oldest": c.max_age, "hit_rate": c.hits / asked if asked else 0.0,
                          "lookup_hit_rate": c.hit_lookups / c.lookups if c.lookups else 0.0}}

    def _replica_status(self) -> dict[str, Any]:
        """--dense allreduce: which step the replica is at, its digest (equal on every trainer of
        the group at that step) and the group."""
        replica = self._replica()
        if replica is None:
            return {}
        step, digest = replica.digested()       # as one: the weights at that step
        if not self._digests or self._digests[-1][0] != step:
            self._digests.append((step, digest))
        return {"dense_replica": {"step": step, "digest": digest, "allreduce_group": list(replica.group),
                                  "group_id": replica.group_key, "digests": list(self._digests)}}
