"""A step's end once its backward ran, as the job's consistency says (``StepEnd``; the servers'
side is ``ps/server/update.py``):

* async: the global norm of this trainer's gradients (one round to every server; with the
  backward run on the trainer, taken there); a server (or the trainer) that finds them not finite
  refuses the step there, before any server applies any of it; else clip and have every server
  apply its share (with the backward run on the trainer, its gradients in the same message);
* ssp:K: the same, then report the step to the leader's step clock;
* sync: hand the gradients to every server, then arrive at the clock, which answers once the
  step's averaged (and clipped) update is applied everywhere. A server refuses gradients that
  are not finite; the trainer then arrives as refused, and the step goes on without it;
* hybrid: the rows as in async, each trainer's own update clipped by its own norm; the replica's
  average (all-reduced in backward) clipped by its norm, the same on every trainer, and applied
  by each alike, even when the rows were refused; then report the step to the clock.

A refused step raises ``UpdateRefused`` once the clock is told: the caller skips that batch. A
step that fails because a server other than the leader went away (died, restarted, or stopped
answering) raises ``ServerLost`` once the clock is told (``ps/client/losses.py``); the caller
waits for the server's return and goes on.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from ps.client.fetching import Fetching, Pushes
from ps.client.lookups import LookupPlan
from ps.spec.messages import Mark
from ps.spec.rules import clip_coef, grad_sq_norm
from ps.spec.surface import PsSurface
from services.errors import UpdateRefused
from services.remote import wait

if TYPE_CHECKING:
    from ps.client.client import PsClient


class Replica(Protocol):
    """Weights every trainer holds a copy of, all-reduced among the trainers (``trainer/core/replica.py``)."""

    def averaged(self, grads: dict[torch.Tensor, torch.Tensor]) -> Optional[dict[torch.Tensor, torch.Tensor]]: ...
    def sq_norm(self, grads: Optional[dict[torch.Tensor, torch.Tensor]]) -> float: ...
    def apply(self, grads: Optional[dict[torch.Tensor, torch.Tensor]], coef: float, step: int) -> None: ...
    def leave_group(self) -> None: ...


def wait_all(futures: list[torch.futures.Future]) -> tuple[list[Any], Optional[UpdateRefused]]:
    """Every server's answer, and a refusal if one refused: the others are still waited for, so
    the step's fate is known on every server before the caller goes on."""
    answers, refused = [], None
    for f in futures:
        try:
            answers.append(wait(f))
        except UpdateRefused as exc:
            refused = exc
    return answers, refused


@dataclass
class Finished:
    """What ``StepSession.finish`` did, and how long each part took."""

    grad_norm: float          # before clipping; sync: of the averaged gradient (nan when not clipped)
    backward: float
    clip: float
    optimize: float           # sync: handing the gradients over
    barrier: float = 0.0      # at the step clock (sync: until the step was applied everywhere)
    arrived_at: float = 0.0   # time.monotonic() when it reported the step to the step clock (0: async)
    weights: Optional["Fetching"] = None    # the dense tensors as the update left them, when asked for
    backward_cpu: float = 0.0   # this thread's CPU seconds in ``backward`` (the rest of it is waiting)


class StepEnd:
    """The end of ``client``'s step: ``context_id`` its distributed autograd context (None: its
    backward ran on the trainer, and its gradients go with the update); ``grads()`` the step's
    gradients by tensor. Its gradients are planned, and its rounds sent, by the client's routes
    as the end began (``routes``): a layout followed meanwhile cannot mismatch the two."""

    def __init__(self, client: PsClient, context_id: Optional[int], grads: Callable[[], Any],
                 read_at: Optional[dict[int, int]] = None) -> None:
        self.client, self.context_id, self._grads = client, context_id, grads
        self.routes = client.routes
        self.local = context_id is None
        self.read_at = read_at or {}      # local: by server, its updates when the step first read there

    def lost(self, exc: Exception, replica: Optional[Replica]) -> Exception:
        """A clocked step that failed, told to the clock (or the server loss it was)."""
        return self.client.losses.failed(exc, replica) or self.client.clock.lose_step(exc, replica)

    def _replicated(self, replica: Optional[Replica]) -> Optional[dict[torch.Tensor, torch.Tensor]]:
        """The replica's averaged gradients of the step (None without one, or when they are
        skipped); its average may all-reduce (hot rows): a peer may die in it."""
        if replica is None:
            return None
        try:
            return replica.averaged(self._grads())
        except Exception as exc:
            raise self.lost(exc, replica) from exc

    def hand_over(self, backward: float, clip: float, replica: Optional[Replica], leaves: Pushes,
                   mark: Optional[Mark]) -> Finished:
        """sync: hand the gradients to every server; the step clock has them applied, averaged
        with the other trainers', once every trainer has."""
        client, routes = self.client, self.routes
        t1 = time.perf_counter()
        replicated = self._replicated(replica)
        _, refused = wait_all([client.ask(n, PsSurface.contribute, self.context_id, client.clock.granted.step,
                                          *(leaves.get(k) or (None, None)), mark, epoch=routes.epoch)
                               for k, n in enumerate(routes.servers)])
        t3 = time.perf_counter()
        applied, arrived_at = client.clock.arrive(clip, refused is not None,
                                            replica.sq_norm(replicated) if replica is not None else 0.0)
        if replica is not None and applied.participants:
            # Every trainer all-reduced the same gradients and reads the same norm: every
            # replica takes the same update, whether or not the servers refused its own rows.
            replica.apply(replicated, clip_coef(clip, applied.grad_norm), applied.step)
        if refused is not None:
            raise refused
        return Finished(applied.grad_norm, backward, 0.0, t3 - t1, time.perf_counter() - t3, arrived_at)

    def _grad_norm(self, leaves: Pushes) -> float:
        """The global norm of every shard's gradients of this step, ``leaves`` (``StepSession._leaf_grads``)
        pushed with the question to its servers (local: all of them, the norm taken here);
        ``UpdateRefused`` if they are not finite (found by a server, or here)."""
        client, routes = self.client, self.routes
        if self.local:
            # In fp32, as a server takes it: a half-precision wire's squares add up past fp16's range.
            parts = [grad_sq_norm([g.float() for _, g in rows.values()] + [g.float() for g in dense.values()])
                     for rows, dense in leaves.values()]
        else:
            parts, refused = wait_all([client.ask(n, PsSurface.grad_sq_norm, self.context_id, *leaves.get(k, ()),
                                                  epoch=routes.epoch) for k, n in enumerate(routes.servers)])
            if refused is not None:
                raise refused
        norm = sum(parts) ** 0.5
        if not math.isfinite(norm):   # finite parts, too large to add up
            raise UpdateRefused(f"this step's gradient norm is {norm}: nothing of it was applied")
        return norm

    def apply_own(self, backward: float, clip: float, leaves: Pushes, weights: bool,
                   mark: Optional[Mark], replica: Optional[Replica]) -> Finished:
        """async, ssp and hybrid: this trainer's own update of the rows (and dense tensors the
        servers hold), checked finite across every server, then applied on each, clipped as the
        norm says (in the same call); hybrid then updates the ``replica``; a clocked mode then
        reports the step to the clock."""
        client, routes = self.client, self.routes
        t1 = time.perf_counter()
        replicated = self._replicated(replica)
        replica_sq = replica.sq_norm(replicated) if replica is not None else 0.0
        try:
            norm = self._grad_norm(leaves)
        except UpdateRefused:
            self._step_replica(replica, replicated, clip, replica_sq)
            if client.consistency.clocked:
                client.clock.arrive(clip, refused=True)      # its step is over, without an update of its own
            raise
        t2 = time.perf_counter()
        dense = routes.dense_shards if weights else []
        # local: the whole update, and when the step first read there; else pushed with the norm round.
        carried = (lambda k: (*leaves.get(k, ({}, {})), self.read_at.get(k))) if self.local else (lambda k: ())
        applies = [client.ask(n, PsSurface.apply, self.context_id, clip_coef(clip, norm), k in dense, mark, *carried(k),
                              epoch=routes.epoch) for k, n in enumerate(routes.servers)]
        for f in applies:
            wait(f)
        self._step_replica(replica, replicated, clip, replica_sq)
        t3, arrived_at = time.perf_counter(), 0.0
        if client.consistency.clocked:
            _, arrived_at = client.clock.arrive(clip)
        left = Fetching(LookupPlan([], {}), [], [applies[k] for k in dense], dense) if dense else None
        return Finished(math.sqrt(norm ** 2 + replica_sq), backward, t2 - t1, t3 - t2, time.perf_counter() - t3,
                        arrived_at, left)

    def _step_replica(self, replica: Optional[Replica], replicated: Optional[dict[torch.Tensor, torch.Tensor]],
                      clip: float, sq: float) -> None:
        """hybrid: the replica's average, clipped by its own norm: the same update on every trainer."""
        if replica is not None:
            replica.apply(replicated, clip_coef(clip, math.sqrt(sq)), self.client.clock.granted.step)
