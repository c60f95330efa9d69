"""Updates a server refuses whole: one trainer's gradients that are not finite must not poison the
shared model, so they are found before any server applies any of them, and counted; and the
requests of a member's old incarnation (``services.remote``'s fencing token), and those planned
with an older layout than the server's, counted too."""
from __future__ import annotations

import math
import threading

import torch

from ps.server.metrics import PsMetrics
from ps.spec.rules import grad_sq_norm
from services.errors import UpdateRefused


class Refusals:
    def __init__(self, metrics: PsMetrics) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()     # RPC threads refuse at once
        self.count = 0
        self.superseded = 0             # requests of old incarnations refused
        self.stale = 0                  # requests planned with another layout, refused

    def old_incarnation(self, caller: str, method: str) -> None:
        with self._lock:
            self.superseded += 1
        self.metrics.requests_superseded.inc()

    def stale_layout(self) -> None:
        with self._lock:
            self.stale += 1
        self.metrics.requests_stale.inc()

    def finite_sq_norm(self, grads: dict[torch.Tensor, torch.Tensor], caller: str, what: str) -> float:
        """The gradients' squared norm, or ``UpdateRefused`` naming the ``caller`` and ``what`` they
        were. A NaN or inf anywhere makes the sum so, which saves a pass of its own."""
        sq = grad_sq_norm(list(grads.values()))
        if math.isfinite(sq):
            return sq
        with self._lock:
            self.count += 1
        self.metrics.updates_refused.inc()
        raise UpdateRefused(f"{caller}'s {what} is not finite; nothing of it was applied")
