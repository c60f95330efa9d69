"""The trainer-side client of the parameter servers: the only place trainers touch RPC.

It hides the fan-out. A lookup is staged: planned (``ps/client/lookups.py``: ids deduplicated, each
owning shard's share in requests within the servers' ``--max-ids-per-request``), issued to every
shard at once (``issue``, which returns the answers on their way as a ``Fetching``), and collected
back into the batch's shape. An operation asks every shard in parallel. A training step is a ``StepSession``: inside
its distributed autograd context everything fetched carries the way back for gradients, and
``finish`` runs backward and ends the step as the job's consistency says (``ps/server/update.py``):

* async: the global norm of this trainer's gradients (one round to every server); a server that
  finds them not finite refuses the step there, before any server applies any of it; else clip
  and have every server apply its share;
* ssp:K: the same, then report the step to the leader's step clock;
* sync: hand the gradients to every server, then arrive at the clock, which answers once the
  step's averaged (and clipped) update is applied everywhere. A server refuses gradients that
  are not finite; the trainer then arrives as refused, and the step goes on without it.

A refused step raises ``UpdateRefused`` once the clock is told: the caller skips that batch. A
step that fails because a server other than the leader went away (died, restarted, or stopped
answering) raises ``ServerLost`` once the clock is told (``PsClient.failed``); the caller waits
for the server's return (``PsClient.returned``) and goes on.

In sync and ssp modes ``begin`` at each step boundary waits until the clock lets this trainer
begin its next step, and ``ClockPause`` holds the trainer there for a checkpoint.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed.autograd as dist_autograd

from ps.client.cache import HotRows, Taken
from ps.client.lookups import LookupPlan, plan_lookups
from ps.spec.consistency import Consistency
from ps.spec.rules import clip_coef
from ps.spec.messages import FREEZE_SECONDS, Applied, Granted, ShardInfo
from ps.spec.sharding import HashedPlan, from_placement
from ps.spec.surface import ClockSurface, PsSurface
from services.errors import PeerUnavailable, ServerLost, StepLost, UpdateRefused
from services.membership import member_ranks, probe
from services.remote import call_async, in_autograd_context, wait

log = logging.getLogger(__name__)

# Gradients pushed with a step's norm round or hand-over, per server: its rows' parameter ->
# (ids, gradients), and its dense tensors' name -> gradient (``PsSurface.push``'s arguments).
Pushes = dict[int, tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]

PROBE_SECONDS = 2.0    # a server that does not answer a no-op within this is counted lost
FORGET_SECONDS = 15.0  # the leader evicts a dead member within about 3 s (two missed probes)


def tensor_bytes(value: Any) -> tuple[int, int]:
    """The bytes of the tensors in ``value`` (in tuples, lists and dicts), and of those among them
    that carry gradients back the other way at distributed backward."""
    if isinstance(value, torch.Tensor):
        size = value.numel() * value.element_size()
        return size, size if value.requires_grad else 0
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    total = grads = 0
    for item in items:
        t, g = tensor_bytes(item)
        total, grads = total + t, grads + g
    return total, grads


class Traffic:
    """The tensor bytes this trainer's RPCs moved to and from the servers, distributed backward's
    gradients included (each as large as the tensor it is the gradient of): payloads, counted as
    they are handed to RPC, not wire bytes. And the messages: each call, and each gradient message
    distributed backward sends (one per answer that carried tensors needing gradients)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.messages = 0

    def add(self, sent: int, received: int, messages: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
            self.messages += messages

    def call(self, args: tuple, future: torch.futures.Future, in_step: bool) -> None:
        """``in_step``: issued in a step's autograd context, where what needs gradients gets them."""
        sent, grads_back = tensor_bytes(args)
        self.add(sent, grads_back if in_step else 0, 1)

        def answered(f: torch.futures.Future) -> None:
            try:
                received, grads_sent = tensor_bytes(f.value())
            except Exception:  # noqa: BLE001 - a failed call moved no answer; its caller hears of it
                return
            if not in_step:
                grads_sent = 0
            self.add(grads_sent, received, 1 if grads_sent else 0)
        future.add_done_callback(answered)

    @property
    def total(self) -> int:
        with self._lock:
            return self.sent + self.received

    @property
    def calls(self) -> int:
        with self._lock:
            return self.messages


def check_server(ps_names: list[str], k: int, info: ShardInfo, first: ShardInfo) -> None:
    """``info``, the answer of server ``k`` of ``ps_names``, against the first server's:
    ``PeerUnavailable`` saying what differs."""
    name = ps_names[k]
    if info.shard != k or info.num_shards != len(ps_names):
        raise PeerUnavailable(f"{name} serves shard {info.shard} of {info.num_shards}, "
                              f"expected shard {k} of {len(ps_names)}: check --num-ps everywhere")
    shapes = getattr(info, "row_shapes", None)      # an older server's answer has none
    if shapes is None or set(shapes) != {p for params in info.table_params.values() for p in params}:
        raise PeerUnavailable(f"{name} does not say the shapes of its rows: it runs an older rpcps than "
                              "this trainer; run one version on every member")
    if info.model != first.model:
        raise PeerUnavailable(f"{name} hosts a different model than {ps_names[0]}")
    if info.consistency != first.consistency:
        raise PeerUnavailable(f"{name} runs consistency {info.consistency}, {ps_names[0]} "
                              f"{first.consistency}: start every server with the same --consistency")


class PsClient:
    def __init__(self, me: str, ps_names: list[str], timeout: float = 60.0) -> None:
        self.me, self.ps_names, self.timeout = me, ps_names, timeout
        self.traffic = Traffic()
        infos: list[ShardInfo] = [wait(f) for f in [self._async(n, PsSurface.info) for n in ps_names]]
        self._first = infos[0]        # what every server, and one back from a restart, must agree with
        for k, info in enumerate(infos):
            check_server(ps_names, k, info, infos[0])
        self.consistency = Consistency.parse(infos[0].consistency)
        self.leader = ps_names[0]                             # keeps the step clock
        self.granted: Optional[Granted] = None                # the step under way, as the clock granted it
        self.start_with = 0           # sync: the trainers the job starts with, whom its first step waits for
        self.lockstep = False         # sync: weights replicated among the trainers: steps begin in lockstep
        # What ``read_ahead`` set: ssp's steps further on whose rows each step reads (a prefetch,
        # a cache), and the copies of the rows read most (``ps/client/cache.py``).
        self.ahead = 0
        self.cache: Optional[HotRows] = None
        self.steps = 0                             # steps begun: the cache counts its copies' ages in them
        self.session: Optional[StepSession] = None   # the step under way
        self.model: dict[str, Any] = infos[0].model          # the workload's description of its model
        placed = infos[0].placement
        self.plans = {table: from_placement(placed.get(table, ("row_wise", 0)), len(ps_names),
                                            sum(i.tables[table] for i in infos))
                      for table in infos[0].tables}
        self.table_of = {param: table for table, params in infos[0].table_params.items() for param in params}
        self._dense_shards = [k for k, info in enumerate(infos) if info.dense]
        self.max_ids = min(info.max_ids for info in infos)     # the most ids one request may name
        self.row_shapes = infos[0].row_shapes
        ranks = member_ranks()
        self._ranks = {n: ranks.get(n) for n in ps_names}    # a server's rank changes when it restarts

    def _async(self, ps: str, method: Callable[..., Any], *args: Any) -> torch.futures.Future:
        future = call_async(ps, method, *args, timeout=self.timeout)
        self.traffic.call(args, future, in_autograd_context())
        return future

    def call(self, ps: str, method: Callable[..., Any], *args: Any) -> Any:
        """One method of one server, synchronously."""
        return wait(self._async(ps, method, *args))

    def ask(self, ps: str, method: Callable[..., Any], *args: Any) -> torch.futures.Future:
        """One method of one server, its answer to wait for (``services.remote.wait``)."""
        return self._async(ps, method, *args)

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
        ssp = self.consistency.clocked and not self.consistency.averaged
        self.ahead = max(early, kept) if ssp else 0
        self.cache = cache

    def step(self) -> "StepSession":
        """A training step: ``with client.step() as step: ... step.finish(loss, clip)``."""
        return StepSession(self)

    def begin(self) -> float:
        """At a step boundary: wait until the job's consistency lets this trainer begin its next
        step (async: at once; no wait either when it has begun that step already). The seconds it
        waited."""
        if not self.consistency.clocked or self.granted is not None:
            return 0.0
        started = time.perf_counter()
        self.granted = wait(self._async(self.leader, ClockSurface.begin, self.start_with, self.ahead, self.lockstep))
        return time.perf_counter() - started

    def arrive(self, clip: float, refused: bool = False, replica_sq: float = 0.0,
               broken: bool = False) -> tuple[Applied, float]:
        """Report the step begun to the step clock; its answer (sync: once the step is applied
        everywhere) and when it was reported (``time.monotonic()``)."""
        arrived_at = time.monotonic()
        try:
            applied: Applied = wait(self._async(self.leader, ClockSurface.arrive, float(clip), refused,
                                                float(replica_sq), broken))
        finally:
            self.granted = None      # reported, even if its step then failed: the clock knows
        return applied, arrived_at

    def lose_step(self, why: BaseException, replica: Optional[Replica] = None) -> StepLost:
        """The step begun failed before it could hand its gradients over. In sync and ssp modes
        the clock is told, so nobody waits for this trainer's part of it. With a ``replica``, the
        failure was in (or may have left) the trainers' group: this trainer leaves it at once, so
        no peer waits on it there, and the clock forms a new one. The error for the caller to raise."""
        if replica is not None:
            replica.leave_group()
        if self.consistency.clocked and self.granted is not None:
            try:
                self.arrive(0.0, refused=True, broken=replica is not None)
            except Exception as exc:  # noqa: BLE001 - the leader is gone too: the next begin says so
                log.warning("could not tell the step clock this step is lost: %s", str(exc).splitlines()[0])
        self.granted = None
        return StepLost(f"this step was lost, nothing of it applied: {str(why).splitlines()[0]}")

    def failed(self, why: BaseException, replica: Optional[Replica] = None) -> Optional[ServerLost]:
        """What a step's failure ``why`` means. ``ServerLost``, the step ended as ``lose_step``
        ends it, when servers other than the leader went away; None when it is not this client's
        to explain (a refusal, a step already lost, the leader gone, a bug): the caller raises it."""
        if isinstance(why, (UpdateRefused, StepLost)):
            return None
        lost = self.lost_servers()
        if not lost or self.leader in lost:
            return None
        if self.cache is not None:
            self.cache.forget()      # a server back from a checkpoint holds other rows than the copies
        self.lose_step(why, replica)
        self._until_forgotten(lost)
        return ServerLost(f"{', '.join(lost)} went away, and this step was lost ({str(why).splitlines()[0]})",
                          tuple(lost))

    def _until_forgotten(self, lost: list[str]) -> None:
        """Wait, at most ``FORGET_SECONDS``, until this process no longer knows ``lost`` under
        the ranks it had (the leader evicts a dead member within seconds). Called inside the
        failed step's autograd context, so that its release, which tells every server of the
        context, finds the dead one unknown: torch 2.13 releasing it while the eviction removes
        that member reads freed memory (``std::bad_alloc`` in the log, then aborts)."""
        deadline = time.monotonic() + FORGET_SECONDS
        while time.monotonic() < deadline:
            ranks = member_ranks()
            if all(ranks.get(n) != self._ranks[n] for n in lost):
                return
            time.sleep(0.05)  # noqa: sleep-ok (polling this process's member list, bounded)
        log.warning("%s still known to this process after %.0fs", ", ".join(lost), FORGET_SECONDS)

    def lost_servers(self) -> list[str]:
        """The servers this client can no longer count on: gone from the group, back under a new
        rank (restarted, so what a step had begun with it is gone), or silent to a probe."""
        ranks = member_ranks()
        present = [n for n in self.ps_names if ranks.get(n) == self._ranks[n]]
        answered = probe(present, timeout=PROBE_SECONDS)
        return [n for n in self.ps_names if not answered.get(n, False)]

    def returned(self, names: list[str]) -> list[str]:
        """Of ``names``, the servers serving again: in the group and answering as the same shard
        of the same model (``PeerUnavailable`` if one came back as another). Each one's new rank
        is remembered."""
        ranks = member_ranks()
        back = []
        for name in [n for n in names if n in ranks]:
            try:
                info: ShardInfo = wait(call_async(name, PsSurface.info, timeout=PROBE_SECONDS))
            except Exception:  # noqa: BLE001 - joining, restoring its shard, or gone again: not yet
                continue
            check_server(self.ps_names, self.ps_names.index(name), info, self._first)
            self._ranks[name] = ranks[name]
            back.append(name)
        return back

    def end(self) -> None:
        """This trainer takes no more steps for now (its episode ended): nobody waits for it."""
        if self.consistency.clocked:
            self.granted = None
            self.call(self.leader, ClockSurface.leave)

    def issue(self, lookups: dict[str, torch.Tensor], dense: bool = True, ahead: int = 0) -> "Fetching":
        """Ask for rows of table parameters (``lookups``: parameter -> ids [...] of its table) and,
        with ``dense``, every dense tensor, all at once, and return without waiting: each server's
        share of the deduplicated ids in as few requests as ``--max-ids-per-request`` allows
        (``ps/client/lookups.py``). Issued inside a step's autograd context, the answers carry the
        way back for that step's gradients. For a step (the one under way, or the one ``ahead``
        steps after the last begun) rows the cache holds fresh enough are taken from it instead."""
        copies = None
        if self.cache is not None and (self.session is not None or ahead or self.cache.replicated):
            copies, lookups = Copies.take(self, lookups, ahead)
        plan = plan_lookups(lookups, self.plans, self.table_of, self.max_ids, self.row_shapes,
                            copies.taken if copies is not None else ())
        answers = [self._async(self.ps_names[k], PsSurface.lookup_many, ask) for k, ask in plan.requests]
        dense_shards = self._dense_shards if dense else []
        dense_futures = [self._async(self.ps_names[k], PsSurface.dense_params) for k in dense_shards]
        fetching = Fetching(plan, answers, dense_futures, dense_shards, copies)
        if self.session is not None:
            self.session.track(fetching)
        return fetching

    def pushable(self, lookups: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``lookups`` cut in two: those whose gradients a step may push, so it may read them before
        it begins or take them from the cache, and those it must read in its own context: a
        hashed table's, whose reading admits ids and whose rows change hands."""
        early = {p: ids for p, ids in lookups.items() if not isinstance(self.plans[self.table_of[p]], HashedPlan)}
        return early, {p: ids for p, ids in lookups.items() if p not in early}

    def fetch(self, lookups: dict[str, torch.Tensor], dense: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``issue`` and wait for it: the rows, each [..., *row shape] as its ids were shaped, and
        the dense tensors by name."""
        return self.issue(lookups, dense).collect()

    def each_dense_shard(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """``method`` of every server that holds dense tensors, at once; their answers."""
        return [wait(f) for f in [self._async(self.ps_names[k], method, *args) for k in self._dense_shards]]

    def op(self, name: str, *args: Any) -> list[Any]:
        """The model's server-side operation ``name`` on every shard at once; their answers in shard order."""
        return [wait(f) for f in [self._async(n, PsSurface.op, name, *args) for n in self.ps_names]]


class Fetching:
    """Lookups issued and not yet collected: what a step waits for, and where a prefetch or a
    row cache comes in (the plan says which rows each answer holds). Issued outside a step's
    context (a prefetch), the answers carry no way back: a step ``adopt``s them, computes with
    them as its own leaves, and pushes their gradients (``StepSession.finish``)."""

    def __init__(self, plan: LookupPlan, answers: list[torch.futures.Future],
                 dense: list[torch.futures.Future], dense_servers: list[int], copies: Optional[Copies] = None) -> None:
        self.plan, self._answers, self._dense = plan, answers, dense
        self._dense_servers = dense_servers      # the server of each dense answer
        self.copies = copies                     # rows taken from the cache
        self.issued_at = time.perf_counter()
        self._landed: list[float] = []       # when each answer came (RPC threads append)
        for f in (*answers, *dense):
            f.add_done_callback(lambda _: self._landed.append(time.perf_counter()))
        self._leaves: Optional[tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]] = None

    @property
    def has_leaves(self) -> bool:
        """Whether a step computed with tensors of this process from it (adopted, or cache copies)."""
        return self._leaves is not None or self.copies is not None

    def done(self) -> bool:
        """Every answer is in (``collect`` would not wait)."""
        return all(f.done() for f in (*self._answers, *self._dense))

    def hidden(self) -> float:
        """Called as a step begins to wait for the answers: the seconds of the read that passed
        before (from its issue to its last answer, or to now), hidden behind other work."""
        now = time.perf_counter()
        landed = max(self._landed, default=self.issued_at) if self.done() else now
        return max(0.0, min(landed, now) - self.issued_at)

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Wait for the answers: each parameter's rows in its ids' shape, and the dense tensors."""
        return self._assemble([wait(f) for f in self._answers], [wait(f) for f in self._dense])

    def adopted(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``collect``, each answer made a leaf of this process's graph, whose gradients
        ``pushes`` hands back."""
        rows = [{p: t.detach().requires_grad_() for p, t in wait(f).items()} for f in self._answers]
        dense = [{n: t.detach().requires_grad_() for n, t in wait(f).items()} for f in self._dense]
        self._leaves = rows, dense
        return self._assemble(rows, dense)

    def _assemble(self, rows: list[dict[str, torch.Tensor]], dense: list[dict[str, torch.Tensor]]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        weights: dict[str, torch.Tensor] = {}
        for answer in dense:
            weights.update(answer)
        collected = self.plan.collect(rows)
        if self.copies is not None:
            self.copies.assemble(collected, rows)
        return collected, weights

    def pushes(self, grads: dict[torch.Tensor, torch.Tensor]
               ) -> list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]:
        """The adopted leaves' gradients (``grads``: a step context's, by tensor), one message per
        answer as distributed backward sends them: (server, its rows' parameter -> (ids,
        gradients), its dense tensors' name -> gradient). A leaf the loss did not reach has none."""
        out = [] if self.copies is None else self.copies.pushes(grads)
        if self._leaves is not None:
            rows, dense = self._leaves
            out += [(k, {p: (ask[p], grads[t]) for p, t in answer.items() if t in grads}, {})
                    for (k, ask), answer in zip(self.plan.requests, rows)]
            out += [(k, {}, {n: grads[t] for n, t in answer.items() if t in grads})
                    for k, answer in zip(self._dense_servers, dense)]
        return [push for push in out if push[1] or push[2]]


class Copies:
    """The rows a read took from the cache (``taken``, by parameter), read at step ``read_at``:
    put back among the rows read, which the cache then keeps; and the gradients of those taken,
    cut for their servers as ``hits`` plans them."""

    def __init__(self, cache: HotRows, taken: dict[str, Taken], hits: LookupPlan, read_at: int,
                 table_rows: dict[str, int]) -> None:
        self.cache, self.taken, self.hits, self.read_at, self.table_rows = cache, taken, hits, read_at, table_rows
        self._leaves: dict[str, torch.Tensor] = {}

    @classmethod
    def take(cls, client: PsClient, lookups: dict[str, torch.Tensor], ahead: int
             ) -> tuple[Optional["Copies"], dict[str, torch.Tensor]]:
        """What ``client``'s cache gives of ``lookups`` for the step ``ahead`` after the last one
        begun (0: the one under way), and the lookups left to read."""
        cache = client.cache
        early, _ = client.pushable(lookups)
        taken = {p: cache.take(p, ids, client.steps + ahead) for p, ids in early.items() if ids.numel()}
        if not taken:
            return None, lookups
        left = {p: ids for p, ids in lookups.items() if p not in taken}
        left.update({p: t.miss_ids for p, t in taken.items() if t.miss_ids.numel()})
        hits = plan_lookups({p: t.hit_ids for p, t in taken.items() if t.hit_ids.numel()}, client.plans,
                            client.table_of, client.max_ids, distinct=taken)
        # What a read gives reflects every step applied before it: the one under way's not yet.
        read_at = client.steps + (0 if client.session is not None else 1)
        return cls(cache, taken, hits, read_at, {p: client.plans[client.table_of[p]].num_ids for p in taken}), left

    def assemble(self, rows: dict[str, torch.Tensor], answers: list[dict[str, torch.Tensor]]) -> None:
        """``rows`` (what the plan collected: a cached parameter's as its ``miss_ids``) completed in
        place with the copies taken, each a leaf whose gradient ``pushes`` hands back."""
        for param, taken in self.taken.items():
            read = rows.get(param)
            if read is None:                               # every id taken from the cache
                read = taken.hit_rows[:0]
            else:
                wire = next(a[param] for a in answers if param in a)
                self.cache.store(param, taken.miss_ids, read, self.read_at, self.table_rows[param])
                self.cache.note_row_bytes(param, wire[0].numel() * wire.element_size() if wire.numel() else 0)
            leaf = self._leaves[param] = taken.hit_rows.requires_grad_()
            rows[param] = taken.assemble(leaf, read)
            self.cache.count(param, taken)

    def pushes(self, grads: dict[torch.Tensor, torch.Tensor]) -> list[tuple[int, dict, dict]]:
        """The gradients of the copies taken, for their servers (none for replicas: the trainers
        average and apply those themselves)."""
        got = {p: grads[t] for p, t in self._leaves.items() if t in grads and self.taken[p].hit_ids.numel()}
        if not got or self.cache.replicated:
            return []
        parts = self.hits.spread(got)
        return [(k, part, {}) for (k, _), part in zip(self.hits.requests, parts)]


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
    """One step's distributed autograd context, and its end: backward, clipping, the update.

    It is the one owner of that context: it opens it, every lookup issued on this thread until
    ``finish`` is recorded in it (the way back for the step's gradients), ``finish`` runs backward
    and hands the gradients over by its id, and leaving the ``with`` block releases it. torch
    allows one such context per thread, so what is issued for a later step before this one ends
    (a prefetch) must be issued in that step's own session."""

    def __init__(self, client: PsClient) -> None:
        self.client = client
        self._context: Any = None
        self.context_id = -1
        self._fetched: list[Fetching] = []      # what this step read, whose leaves it pushes the gradients of

    def __enter__(self) -> "StepSession":
        self._context = dist_autograd.context()
        self.context_id = self._context.__enter__()
        self.client.steps += 1
        self.client.session = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.session = None
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
        for f in [client._async(client.ps_names[k], PsSurface.push, self.context_id, part)
                  for (k, _), part in zip(plan.requests, pushes)]:
            wait(f)

    def fetch(self, lookups: dict[str, torch.Tensor], dense: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.client.fetch(lookups, dense)

    def finish(self, loss: torch.Tensor, clip: float, replica: Optional[Replica] = None,
               weights: bool = False) -> Finished:
        """Send ``loss``'s gradients back to the servers, clip their global norm to ``clip`` (0:
        off), and apply them as the job's consistency says; sync mode also updates the trainers'
        ``replica`` of the weights they hold themselves (``--dense allreduce``). With ``weights``
        (async and ssp), the servers answer the apply with their dense tensors as it left them:
        ``Finished.weights``, a read the next step may adopt."""
        client = self.client
        averaged = client.consistency.averaged
        if averaged and client.granted is None:
            raise RuntimeError("a sync step needs client.begin() at its boundary first")
        if replica is not None and not averaged:
            raise RuntimeError("replicated weights are updated in sync mode only")
        t0 = time.perf_counter()
        try:
            dist_autograd.backward(self.context_id, [loss])
            leaves = self._leaf_grads()
        except Exception as exc:
            # A sync step that cannot hand its gradients over still ends at the clock, or every
            # other trainer would wait for it (with a replica: a peer in its all-reduce died).
            if not averaged:
                raise
            raise (client.failed(exc, replica) or client.lose_step(exc, replica)) from exc
        backward = time.perf_counter() - t0
        if averaged:
            return self._hand_over(backward, clip, replica, leaves)
        return self._apply_own(backward, clip, leaves, weights)

    def _leaf_grads(self) -> Pushes:
        """The gradients of what the step adopted (read before it) or took from the cache, for the
        servers that own it. They go with the step's norm round or hand-over, so they cost no
        round of their own."""
        if not any(f.has_leaves for f in self._fetched):
            return {}
        grads = dist_autograd.get_gradients(self.context_id)
        out: Pushes = {}
        for fetching in self._fetched:
            for k, rows, dense in fetching.pushes(grads):
                kept_rows, kept_dense = out.setdefault(k, ({}, {}))
                for param, (ids, grad) in rows.items():
                    if param in kept_rows:       # the same table's rows from two answers (a cut request, a copy)
                        ids, grad = torch.cat([kept_rows[param][0], ids]), torch.cat([kept_rows[param][1], grad])
                    kept_rows[param] = (ids, grad)
                kept_dense.update(dense)
        return out

    def _hand_over(self, backward: float, clip: float, replica: Optional[Replica], leaves: Pushes) -> Finished:
        """sync: hand the gradients to every server; the step clock has them applied, averaged
        with the other trainers', once every trainer has."""
        client = self.client
        t1 = time.perf_counter()
        try:        # the replica's average may all-reduce (hot rows): a peer may die in it
            replicated = replica.averaged(dist_autograd.get_gradients(self.context_id)) if replica is not None else None
        except Exception as exc:
            raise (client.failed(exc, replica) or client.lose_step(exc, replica)) from exc
        _, refused = wait_all([client._async(n, PsSurface.contribute, self.context_id, client.granted.step,
                                             *leaves.get(k, ())) for k, n in enumerate(client.ps_names)])
        t3 = time.perf_counter()
        applied, arrived_at = client.arrive(clip, refused is not None,
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
        pushed with the question; ``UpdateRefused`` if a server found them not finite."""
        client = self.client
        parts, refused = wait_all([client._async(n, PsSurface.grad_sq_norm, self.context_id, *leaves.get(k, ()))
                                   for k, n in enumerate(client.ps_names)])
        if refused is not None:
            raise refused
        norm = sum(parts) ** 0.5
        if not math.isfinite(norm):   # finite parts, too large to add up
            raise UpdateRefused(f"this step's gradient norm is {norm}: nothing of it was applied")
        return norm

    def _apply_own(self, backward: float, clip: float, leaves: Pushes, weights: bool) -> Finished:
        """async and ssp: this trainer's own update, checked finite across every server, then
        applied on each, clipped as the norm says (in the same call); ssp then reports the step
        to the clock."""
        client = self.client
        t1 = time.perf_counter()
        try:
            norm = self._grad_norm(leaves)
        except UpdateRefused:
            if client.consistency.clocked:
                client.arrive(clip)      # ssp: its step is over, without an update
            raise
        t2 = time.perf_counter()
        dense = client._dense_shards if weights else []
        applies = [client._async(n, PsSurface.apply, self.context_id, clip_coef(clip, norm), k in dense)
                   for k, n in enumerate(client.ps_names)]
        for f in applies:
            wait(f)
        t3, arrived_at = time.perf_counter(), 0.0
        if client.consistency.clocked:
            _, arrived_at = client.arrive(clip)
        left = Fetching(LookupPlan([], {}), [], [applies[k] for k in dense], dense) if dense else None
        return Finished(norm, backward, t2 - t1, t3 - t2, time.perf_counter() - t3, arrived_at, left)


class ClockPause:
    """A checkpoint's hold on a trainer in sync and ssp modes, at the step clock: the clock stops
    at the furthest step begun, so trainers inside a barrier finish it, and the hold is there once
    this trainer waits at its next ``begin``. (A trainer's own step boundary would deadlock: the
    others in its barrier could never arrive.) ``hold``/``release`` as ``services.control.StepPause``."""

    def __init__(self, client: PsClient) -> None:
        self.client = client

    def hold(self, timeout: float) -> bool:
        client = self.client
        client.call(client.leader, ClockSurface.freeze, FREEZE_SECONDS)
        try:
            return bool(wait(call_async(client.leader, ClockSurface.parked, timeout=timeout)))
        except Exception as exc:  # noqa: BLE001 - not held: say so, and let the others go on
            log.warning("not held at the step clock within %.0fs: %s", timeout, str(exc).splitlines()[0])
            client.call(client.leader, ClockSurface.thaw)
            return False

    def release(self) -> None:
        self.client.call(self.client.leader, ClockSurface.thaw)
