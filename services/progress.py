"""Progress a person can plan with: how much of a known amount of work is done, how long it has
taken, and when the rest will be done at the recent rate.

A role working through a known amount (an episode's steps, a batch of RL episodes, an evaluation's
tokens) keeps a ``Progress``: it shows as ``progress`` in the role's ``/status`` and as the
``rpcps_progress_*`` gauges. ``rpcps up`` combines its members' progress into its own progress line.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from pydantic import BaseModel

RATE_WINDOW_S = 30.0      # the "recent" rate: the work of about the last half minute


class ProgressStatus(BaseModel):
    phase: str                       # what is counted: "train" (steps), "evaluate" (tokens), "episodes"
    done: int = 0
    total: Optional[int] = None      # None: unbounded
    elapsed_s: float = 0.0
    eta_s: Optional[float] = None    # None: unbounded, or too early for a rate


class Progress:
    """One phase of work at a time, published to the status board and the gauges on every advance.
    Used by the role's own thread; the lock keeps a reader of ``report`` consistent with it."""

    def __init__(self, board: Any, metrics: Any, now: Callable[[], float] = time.monotonic) -> None:
        self._board, self._metrics, self._now = board, metrics, now
        self._lock = threading.Lock()
        self._phase, self._total, self._done = "", None, 0
        self._started = now()
        self._samples: deque[tuple[float, int]] = deque()

    def start(self, phase: str, total: Optional[int]) -> None:
        with self._lock:
            self._phase, self._total, self._done = phase, total, 0
            self._started = self._now()
            self._samples = deque([(self._started, 0)])
        self._publish()

    def advance(self, done: int, total: Optional[int] = None) -> None:
        """``done`` so far; ``total`` when the amount is learnt only once the work has begun."""
        with self._lock:
            now = self._now()
            self._done = done
            self._total = self._total if total is None else total
            self._samples.append((now, done))
            # Keep one sample older than the window, so the rate spans the whole window.
            while len(self._samples) > 2 and self._samples[1][0] < now - RATE_WINDOW_S:
                self._samples.popleft()
        self._publish()

    def report(self) -> ProgressStatus:
        with self._lock:
            eta = None
            if self._total is not None and len(self._samples) >= 2:
                (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
                if d1 > d0 and t1 > t0:
                    eta = max(0, self._total - self._done) / ((d1 - d0) / (t1 - t0))
            return ProgressStatus(phase=self._phase, done=self._done, total=self._total,
                                  elapsed_s=round(self._now() - self._started, 3),
                                  eta_s=None if eta is None else round(eta, 1))

    def _publish(self) -> None:
        p = self.report()
        self._board.update(progress=p.model_dump())
        self._metrics.progress_done.set(p.done / p.total if p.total else math.nan)
        self._metrics.progress_eta.set(math.nan if p.eta_s is None else p.eta_s)


def combine(progresses: list[Optional[ProgressStatus]], phase: str) -> dict[str, Any]:
    """Several members' progress in one ``phase`` as ``rpcps up`` shows it: the share done of their
    work together, and the slowest member's ETA (None while any is unknown)."""
    mine = [p for p in progresses if p is not None and p.phase == phase]
    if not mine or any(p.total is None for p in mine):
        return {"percent": None, "eta_s": None}
    total = sum(p.total or 0 for p in mine)
    etas = [p.eta_s for p in mine if p.done < (p.total or 0)]
    return {"percent": round(100.0 * sum(p.done for p in mine) / total, 1) if total else None,
            "eta_s": None if None in etas else max(etas, default=0.0)}


def clock(seconds: Optional[float]) -> str:
    """``1:05:09``, ``4:07``: a duration as a person reads it."""
    if seconds is None or math.isnan(seconds):
        return "-"
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def describe(event: dict[str, Any]) -> str:
    """The progress columns of a progress line: ``35% | 0:42 elapsed | ETA 1:18``."""
    parts = []
    if event.get("percent") is not None:
        parts.append(f"{event['percent']:.0f}%")
    if event.get("elapsed_s") is not None:
        parts.append(f"{clock(event['elapsed_s'])} elapsed")
    if event.get("percent") is not None:
        parts.append(f"ETA {clock(event.get('eta_s'))}")
    return " | ".join(parts)
