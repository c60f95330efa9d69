"""A training step on the trainer's side (``StepSession``): what it reads, its backward (by its
distributed autograd context; or, run on the trainer, with no context: its reads are leaves,
their gradients sent with the update), and its end as the job's consistency says
(``ps/client/step_end.py``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed.autograd as dist_autograd

from ps.client.fetching import Fetching, GradOf, Pushes, earliest, merged, replanned, spread_by
from ps.client.routes import Routes
from ps.client.step_end import Finished, Replica, StepEnd
from ps.spec.messages import Mark
from ps.spec.surface import PsSurface
from services.remote import wait

if TYPE_CHECKING:
    from ps.client.client import PsClient


class StepSession:
    """One step: what it read, and its end: backward, clipping, the update.

    Its backward is where the client says (``PsClient.local_backward``). Distributed: the session
    owns the step's distributed autograd context: it opens it, every lookup issued on this thread
    until ``finish`` is recorded in it (the way back for the step's gradients), ``finish`` runs
    backward and hands the gradients over by its id, and leaving the ``with`` block releases it;
    torch allows one such context per thread, so what is issued for a later step before this one
    ends (a prefetch) must be issued in that step's own session. Local: no context; every read is
    a leaf of this process's graph (``Fetching.adopted``), ``finish`` runs plain autograd, and
    the step's end (``StepEnd``) takes the global norm here and sends each server its rows' and
    dense tensors' gradients with the update itself: one message a server."""

    def __init__(self, client: PsClient) -> None:
        self.client = client
        self.local = client.local_backward
        self._context: Any = None
        self.context_id: Optional[int] = None     # distributed: the step's autograd context
        self._fetched: list[Fetching] = []      # what this step read, whose leaves it pushes the gradients of
        # local: ``push``ed (ids, gradients), planned with the step's end by its routes and sent with the update
        self._pushed: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self._push_ids: list[dict[str, torch.Tensor]] = []   # the ids of every ``push``, for ``UpdateCounts``

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
        self._push_ids.append(lookups)
        grads = {param: g.detach().float() for param, g in grads.items()}
        if self.local:
            # Not planned yet: a layout followed before the step ends would send them by its old
            # shard numbers, where the step's other gradients go by the routes its end takes.
            self._pushed.append((lookups, grads))
            return
        client, routes = self.client, self.client.routes
        plan = routes.plan(lookups)
        pushes = plan.spread(grads)
        for f in [client.ask(routes.servers[k], PsSurface.push, self.context_id, part, epoch=routes.epoch)
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
        end = StepEnd(client, self.context_id, self._grads,
                      earliest([s for f in self._fetched for s in f.stamps()]))
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            if self.local:
                torch.autograd.backward([loss])
            else:
                dist_autograd.backward(self.context_id, [loss])
            leaves = self._leaf_grads(end.routes)
        except Exception as exc:
            # A sync step that cannot hand its gradients over still ends at the clock, or every
            # other trainer would wait for it (with a replica: a peer in its all-reduce died).
            if not (averaged or replica is not None):
                raise
            raise end.lost(exc, replica) from exc
        backward, backward_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        try:
            finished = end.hand_over(backward, clip, replica, leaves, mark) if averaged else \
                end.apply_own(backward, clip, leaves, weights, mark, replica)
        except BaseException:
            self._count(acked=False)        # sent: a server may have applied it
            raise
        self._count(acked=True)
        finished.backward_cpu = backward_cpu
        return finished

    def _count(self, acked: bool) -> None:
        if self.client.counts is not None:
            self.client.counts.record([*(f.asked for f in self._fetched), *self._push_ids], acked)

    def _grads(self) -> Any:
        """The step's gradients by tensor: its context's, or (local) its leaves' own."""
        return GradOf() if self.local else dist_autograd.get_gradients(self.context_id)

    def _leaf_grads(self, routes: Routes) -> Pushes:
        """The gradients of what the step adopted (read before it, or locally), took from the
        cache or ``push``ed, for the servers that own it, one message's worth each. They go with
        the step's norm round, update or hand-over, so they cost no round of their own."""
        if not any(f.has_leaves for f in self._fetched) and not self._pushed:
            return {}
        grads = self._grads()
        return merged([push for f in self._fetched for push in replanned(f, f.pushes(grads), routes)]
                      + [push for lookups, pushed in self._pushed for push in spread_by(routes, lookups, pushed)])
