"""The leader's side of a sync step, once the step clock has every trainer's gradients on every
server: the global norm, then every server's apply."""
from __future__ import annotations

from typing import Callable, Sequence

from ps.spec.rules import clip_coef
from ps.spec.surface import PsSurface
from services.remote import call_async, wait


def apply_sync_step(servers: Callable[[], Sequence[str]], timeout: float, step: int, trainers: list[str],
                    clip: float, replica_sq: float = 0.0) -> float:
    """The leader's side of a sync step: the averaged gradient's global norm over every server
    (``servers()``: those of the leader's layout now; it changes only between steps) and the
    trainers' replicated weights, ``replica_sq``, then every server applies the average, clipped
    to ``clip`` (0: off). The norm before clipping."""
    servers = list(servers())
    if clip > 0:
        sq = replica_sq + sum(wait(f) for f in [call_async(n, PsSurface.sync_sq_norm, step, trainers,
                                                           timeout=timeout) for n in servers])
        norm = float(sq) ** 0.5
    else:
        norm = float("nan")
    coef = clip_coef(clip, norm)
    for f in [call_async(n, PsSurface.sync_apply, step, trainers, coef, timeout=timeout) for n in servers]:
        wait(f)
    return norm
