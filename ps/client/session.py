"""A training step on the trainer's side (``StepSession``): its distributed autograd context (or,
with its backward run on the trainer, none: its reads are leaves, their gradients sent with the
update), and its end as the job's consistency says (``ps/server/update.py``):

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
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed.autograd as dist_autograd

from ps.client.fetching import Fetching, GradOf, Pushes, merged
from ps.client.lookups import LookupPlan, plan_lookups
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


class StepSession:
    """One step: what it read, and its end: backward, clipping, the update.

    Its backward is where the client says (``PsClient.local_backward``). Distributed: the session
    owns the step's distributed autograd context: it opens it, every lookup issued on this thread
    until ``finish`` is recorded in it (the way back for the step's gradients), ``finish`` runs
    backward and hands the gradients over by its id, and leaving the ``with`` block releases it;
    torch allows one such context per thread, so what is issued for a later step before this one
    ends (a prefetch) must be issued in that step's own session. Local: no context; every read is
    a leaf here (``Fetching.adopted``), ``finish`` runs plain autograd, takes the global norm, and
    sends each server its gradients with the update itself: one message a server."""

    def __init__(self, client: PsClient) -> None:
        self.client = client
        self.local = client.local_backward
        self._context: Any = None
        self.context_id: Optional[int] = None     # distributed: the step's autograd context
        self._fetched: list[Fetching] = []      # what this step read, whose leaves it pushes the gradients of
        self._pushed: list[tuple[int, dict, dict]] = []   # local: ``push``ed, sent with the update

    def __enter__(self) -> "StepSession":
        if not self.local:
            self._context = dist_autograd.context()
            self.context_id = self._context.__enter__()
        self.client.steps += 1
        self.client.session = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.session = None
        if self._context is not None:
            self._context.__exit__(*exc)

    def track(self, fetching: Fetching) -> None:
        self._fetched.append(fetching)

    def issue(self, lookups: dict[str, torch.Tensor], dense: bool = True) -> Fetching:
        return self.client.issue(lookups, dense)

    def adopt(self, fetching: Fetching) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What ``fetching`` (issued before this step, outside any context: a prefetch) read, as
        ``fetch`` gives it; ``finish`` pushes its gradients to the servers that answered."""
        self.track(fetching)
        return fetching.adopted()

    def push(self, lookups: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """Gradients of table rows this step did not read from the servers (a copy held here):
        ``grads[param]`` [*ids' shape, *row shape] for ``lookups[param]``'s ids. They join the
        step's update on each owning server, as if they had come back through distributed
        autograd; push before ``finish``."""
        client = self.client
        plan = plan_lookups(lookups, client.plans, client.table_of, client.max_ids)
        pushes = plan.spread({param: g.detach().float() for param, g in grads.items()})
        if self.local:
            self._pushed += [(k, part, {}) for (k, _), part in zip(plan.requests, pushes)]
            return
        for f in [client.ask(client.ps_names[k], PsSurface.push, self.context_id, part)
                  for (k, _), part in zip(plan.requests, pushes)]:
            wait(f)

    def fetch(self, lookups: dict[str, torch.Tensor], dense: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.client.fetch(lookups, dense)

    def finish(self, loss: torch.Tensor, clip: float, replica: Optional[Replica] = None,
               weights: bool = False, mark: Optional[Mark] = None) -> Finished:
        """Send ``loss``'s gradients back to the servers, clip their global norm to ``clip`` (0:
        off), and apply them as the job's consistency says; sync mode also updates the trainers'
        ``replica`` of the weights they hold themselves (``--dense allreduce``). With ``weights``
        (async and ssp), the servers answer the apply with their dense tensors as it left them:
        ``Finished.weights``, a read the next step may adopt. ``mark``: the batch's, which each
        server keeps with the update, and by which it applies a batch once (``ps/server/marks.py``)."""
        client = self.client
        averaged = client.consistency.averaged
        if (averaged or replica is not None) and client.clock.granted is None:
            raise RuntimeError("a sync or hybrid step needs client.begin() at its boundary first")
        if replica is not None and "allreduce" not in client.consistency.dense_modes:
            raise RuntimeError(f"replicated weights are updated in sync or hybrid mode, not {client.consistency}")
        t0 = time.perf_counter()
        try:
            if self.local:
                torch.autograd.backward([loss])
            else:
                dist_autograd.backward(self.context_id, [loss])
            leaves = self._leaf_grads()
        except Exception as exc:
            # A sync step that cannot hand its gradients over still ends at the clock, or every
            # other trainer would wait for it (with a replica: a peer in its all-reduce died).
            if not (averaged or replica is not None):
                raise
            raise self._lost(exc, replica) from exc
        backward = time.perf_counter() - t0
        if averaged:
            return self._hand_over(backward, clip, replica, leaves, mark)
        return self._apply_own(backward, clip, leaves, weights, mark, replica)

    def _lost(self, exc: Exception, replica: Optional[Replica]) -> Exception:
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
            raise self._lost(exc, replica) from exc

    def _grads(self) -> Any:
        """The step's gradients by tensor: its context's, or (local) its leaves' own."""
        return GradOf() if self.local else dist_autograd.get_gradients(self.context_id)

    def _leaf_grads(self) -> Pushes:
        """The gradients of what the step adopted (read before it, or locally), took from the
        cache or ``push``ed, for the servers that own it, one message's worth each. They go with
        the step's norm round, update or hand-over, so they cost no round of their own."""
        if not any(f.has_leaves for f in self._fetched) and not self._pushed:
            return {}
        grads = self._grads()
        return merged([push for f in self._fetched for push in f.pushes(grads)] + self._pushed)

    def _hand_over(self, backward: float, clip: float, replica: Optional[Replica], leaves: Pushes,
                   mark: Optional[Mark]) -> Finished:
        """sync: hand the gradients to every server; the step clock has them applied, averaged
        with the other trainers', once every trainer has."""
        client = self.client
        t1 = time.perf_counter()
        replicated = self._replicated(replica)
        _, refused = wait_all([client.ask(n, PsSurface.contribute, self.context_id, client.clock.granted.step,
                                          *(leaves.get(k) or (None, None)), mark)
                               for k, n in enumerate(client.ps_names)])
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
        """The global norm of every shard's gradients of this step, ``leaves`` (``_leaf_grads``)
        pushed with the question (local: all of them, the norm taken here); ``UpdateRefused`` if
        they are not finite (found by a server, or here)."""
        client = self.client
        if self.local:
            # In fp32, as a server takes it: a half-precision wire's squares add up past fp16's range.
            parts = [grad_sq_norm([g.float() for _, g in rows.values()] + [g.float() for g in dense.values()])
                     for rows, dense in leaves.values()]
        else:
            parts, refused = wait_all([client.ask(n, PsSurface.grad_sq_norm, self.context_id, *leaves.get(k, ()))
                                       for k, n in enumerate(client.ps_names)])
            if refused is not None:
                raise refused
        norm = sum(parts) ** 0.5
        if not math.isfinite(norm):   # finite parts, too large to add up
            raise UpdateRefused(f"this step's gradient norm is {norm}: nothing of it was applied")
        return norm

    def _apply_own(self, backward: float, clip: float, leaves: Pushes, weights: bool,
                   mark: Optional[Mark], replica: Optional[Replica]) -> Finished:
        """async, ssp and hybrid: this trainer's own update of the rows (and dense tensors the
        servers hold), checked finite across every server, then applied on each, clipped as the
        norm says (in the same call); hybrid then updates the ``replica``; a clocked mode then
        reports the step to the clock."""
        client = self.client
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
        dense = client.dense_shards if weights else []
        carried = (lambda k: leaves.get(k, ({}, {}))) if self.local else (lambda k: ())   # pushed with the norm round
        applies = [client.ask(n, PsSurface.apply, self.context_id, clip_coef(clip, norm), k in dense, mark, *carried(k))
                   for k, n in enumerate(client.ps_names)]
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
