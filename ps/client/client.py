"""The trainer-side client of the parameter servers: the only place trainers touch RPC.

It hides the fan-out. A lookup is staged: planned (``ps/client/lookups.py``: ids deduplicated, each
owning shard's share in requests within the servers' ``--max-ids-per-request``), issued to every
shard at once (``issue``, which returns the answers on their way as a ``Fetching``,
``ps/client/fetching.py``), and collected back into the batch's shape. An operation asks every
shard in parallel. Its parts, each in a file of its own:

- a training step, ``step()``: a ``StepSession`` (``ps/client/session.py``), whose ``finish`` runs
  backward and ends the step as the job's consistency says (``ps/client/step_end.py``);
- the leader's step clock, ``clock`` (``ps/client/clock.py``), in sync and ssp modes;
- the servers it can no longer count on, ``losses`` (``ps/client/losses.py``): what a failed step
  means, and which servers have come back;
- what its RPCs move, ``traffic`` (``ps/client/traffic.py``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ps.client.cache import HotRows
from ps.client.clock import StepClock
from ps.client.counts import UpdateCounts
from ps.client.fetching import Copies, Fetching
from ps.client.losses import ServerLosses, check_server
from ps.client.routes import Routes
from ps.client.session import StepSession
from ps.client.traffic import Traffic
from ps.spec.consistency import Consistency
from ps.spec.messages import ShardInfo
from ps.spec.sharding import HashedPlan, Slots
from ps.spec.surface import PsSurface
from services.errors import PeerUnavailable, StepLost
from services.remote import call_async, in_autograd_context, wait

log = logging.getLogger(__name__)


WAIT_TIMEOUT = 60.0     # seconds a trainer waits at the step clock for the others, at least


def leaders_layout(leader: str, timeout: float) -> Slots:
    """The layout ``leader`` keeps: the servers a job runs on now, whatever it started on."""
    slots = wait(call_async(leader, PsSurface.layout_now, timeout=timeout))
    if slots.servers[0] != leader:
        raise PeerUnavailable(f"{leader}'s layout {slots.epoch} is led by {slots.servers[0]}")
    return slots


class PsClient:
    def __init__(self, me: str, ps_names: list[str], timeout: float = 60.0) -> None:
        """``ps_names``: the servers, the leader first; those of the leader's layout are the ones
        it talks to."""
        self.me, self.timeout = me, timeout
        self.traffic = Traffic()
        self.leader = ps_names[0]                             # keeps the step clock and the layout
        self.routes: Routes = None  # type: ignore[assignment]   # the leader's layout's, once its servers answered
        slots = self._leaders_layout()
        if list(slots.servers) != list(ps_names):
            log.info("the leader's layout %d is over %s (this trainer was started for %s)", slots.epoch,
                     ", ".join(slots.servers), ", ".join(ps_names))
        ps_names = list(slots.servers)
        infos: list[ShardInfo] = [wait(f) for f in [self.ask(n, PsSurface.info) for n in ps_names]]
        for k, info in enumerate(infos):
            check_server(ps_names, k, info, infos[0], slots.epoch)
        self.consistency = Consistency.parse(infos[0].consistency)
        self.clock = StepClock(self.ask, self.leader, self.consistency)
        self.cache: Optional[HotRows] = None      # copies of the rows read most (``read_ahead``)
        self.steps = 0                             # steps begun: the cache counts its copies' ages in them
        self.session: Optional[StepSession] = None   # the step under way
        self.local_backward = False     # steps run backward here, not by distributed autograd (``backward_here``)
        self.model: dict[str, Any] = infos[0].model          # the workload's description of its model
        table_of = {param: table for table, params in infos[0].table_params.items() for param in params}
        self.routes = Routes.of(slots, infos[0].placement, infos[0].ids, table_of, min(i.max_ids for i in infos))
        # The servers count their rows' updates (``--count-updates``): this trainer counts its own.
        self.counts = UpdateCounts(infos[0].counted, table_of, slots.count) if infos[0].counted else None
        self.row_shapes = infos[0].row_shapes
        self.losses = ServerLosses(lambda: self.routes, self.leader, infos[0], self._lose_step)

    def _leaders_layout(self) -> Slots:
        return leaders_layout(self.leader, self.timeout)

    def follow_layout(self) -> bool:
        """Take the leader's layout again (a server refused a request planned with this one,
        ``StaleLayout``): the plans of every request from now on follow it. Whether it changed."""
        slots, was = self._leaders_layout(), self.routes
        if slots.epoch == was.epoch:
            return False
        log.info("layout %d -> %d: %d moves, servers %s", was.epoch, slots.epoch, len(was.slots.moves(slots)),
                 ", ".join(slots.servers))
        self.losses.track(list(slots.servers))
        # Replaced whole: a read planned with the routes before goes to their servers. The cache's
        # copies stay good: a move changes where a row lives, not its value, and held rows go back
        # to wherever the routes put them now.
        self.routes = was.following(slots)
        return True

    def _lose_step(self, why: BaseException, replica: Any = None) -> StepLost:
        """The step under way ends without its update (servers went away, ``ServerLosses``)."""
        if self.cache is not None:
            self.cache.forget()      # a server back from a checkpoint holds other rows than the copies
        return self.clock.lose_step(why, replica)

    def ask(self, ps: str, method: Callable[..., Any], *args: Any, waits: bool = False,
            epoch: Optional[int] = None) -> torch.futures.Future:
        """One method of one server, its answer to wait for (``services.remote.wait``), planned
        by the layout ``epoch`` (default: this client's now), which goes with the request: a
        server that no longer owns what it names refuses it. ``waits``: the server holds the
        answer until other trainers arrive (the step clock's barrier), which can take longer than
        one peer may stay silent (the RPC timeout); at least ``WAIT_TIMEOUT``."""
        if epoch is None:
            epoch = self.routes.epoch if self.routes is not None else 0
        future = call_async(ps, method, *args, timeout=max(self.timeout, WAIT_TIMEOUT) if waits else self.timeout,
                            version=epoch)
        self.traffic.call(args, future, in_autograd_context())
        return future

    def call(self, ps: str, method: Callable[..., Any], *args: Any) -> Any:
        """One method of one server, synchronously."""
        return wait(self.ask(ps, method, *args))

    def read_ahead(self, early: int = 0, cache: Optional[HotRows] = None) -> None:
        """Steps read their rows ``early`` steps before they train with them (``--prefetch``,
        ``trainer/core/prefetch.py``) and take copies from ``cache``: ``ValueError`` if either is
        staler than the servers' consistency allows. In ssp the step clock counts them as steps
        ahead (``begin``)."""
        kept = cache.staleness if cache is not None else 0
        try:
            self.consistency.check_reads(early, kept)
        except ValueError as exc:
            raise ValueError(f"the servers run {self.consistency}: {exc}") from None
        self.clock.ahead = max(early, kept) if self.consistency.bounded else 0
        self.cache = cache

    def step(self) -> "StepSession":
        """A training step: ``with client.step() as step: ... step.finish(loss, clip)``."""
        return StepSession(self)

    def issue(self, lookups: dict[str, torch.Tensor], dense: bool = True, ahead: int = 0) -> "Fetching":
        """Ask for rows of table parameters (``lookups``: parameter -> ids [...] of its table) and,
        with ``dense``, every dense tensor, all at once, and return without waiting: each server's
        share of the deduplicated ids in as few requests as ``--max-ids-per-request`` allows
        (``ps/client/lookups.py``). Issued inside a step's autograd context, the answers carry the
        way back for that step's gradients. For a step (the one under way, or the one ``ahead``
        steps after the last begun) rows the cache holds fresh enough are taken from it instead."""
        copies, asked, routes = None, lookups, self.routes
        if self.cache is not None and (self.session is not None or ahead or self.cache.replicated):
            # What a read gives reflects every step applied before it: the one under way's not yet.
            read_at = self.steps + (0 if self.session is not None else 1)
            copies, lookups = Copies.take(self.cache, routes, lookups, self.steps + ahead, read_at)
        plan = routes.plan(lookups, self.row_shapes, copies.taken if copies is not None else ())
        # A step whose backward runs here has no context to remember its first read at each
        # server: the answers say when they were read (``Fetching.stamps``).
        read = PsSurface.read_rows if self.local_backward else PsSurface.lookup_many
        answers = [self.ask(routes.servers[k], read, ask, epoch=routes.epoch) for k, ask in plan.requests]
        dense_shards = routes.dense_shards if dense else []
        dense_futures = [self.ask(routes.servers[k], PsSurface.dense_params, epoch=routes.epoch) for k in dense_shards]
        fetching = Fetching(plan, answers, dense_futures, dense_shards, copies, stamped=self.local_backward,
                            servers=tuple(routes.servers), epoch=routes.epoch, asked=asked)
        if self.session is not None:
            self.session.track(fetching)
        return fetching

    def fetch(self, lookups: dict[str, torch.Tensor], dense: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``issue`` and wait for it: the rows, each [..., *row shape] as its ids were shaped, and
        the dense tensors by name (in a step whose backward runs here, leaves of its graph)."""
        fetching = self.issue(lookups, dense)
        return fetching.adopted() if self.session is not None and self.session.local else fetching.collect()

    def backward_here(self) -> None:
        """Steps run plain autograd on this trainer over what they read, and send each server its
        gradients with the update: one message a server, where distributed autograd costs a round
        for the gradients, one for the norm and one to release the step's context. Only for a
        model whose servers compute nothing of its forward, and ``ValueError`` with a hashed
        table, whose reads are recorded in the step's context (ids admitted, rows changing hands)."""
        hashed = sorted(t for t, plan in self.routes.plans.items() if isinstance(plan, HashedPlan))
        if hashed:
            more = f" and {len(hashed) - 1} more" if len(hashed) > 1 else ""
            raise ValueError(f"a hashed table's reads are recorded in the step's distributed autograd context "
                             f"({hashed[0]}{more}): --backward distributed")
        self.local_backward = True

    def each_dense_shard(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """``method`` of every server that holds dense tensors, at once; their answers."""
        routes = self.routes
        return [wait(f) for f in [self.ask(routes.servers[k], method, *args, epoch=routes.epoch)
                                  for k in routes.dense_shards]]

    def op(self, name: str, *args: Any) -> list[Any]:
        """The model's server-side operation ``name`` on every shard at once; their answers in shard order."""
        routes = self.routes
        return [wait(f) for f in [self.ask(n, PsSurface.op, name, *args, epoch=routes.epoch) for n in routes.servers]]
