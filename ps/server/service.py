"""The parameter server: what its RPC surface (``ps/spec/surface.py``) does.

``ParameterServer`` hosts one shard of what a workload's ``ModelSpec`` declares: its rows of every
table, its dense groups, and the spec's named operations. Its ``@remote`` methods are those
``PsSurface`` declares, the whole remote interface; trainers reach them only through
``ps/client/``. Every input is validated (types by ``services/remote.py``, ids and names
here, an operation's own arguments by the operation): a bad request raises ``BadRequest`` back to
its caller and the server keeps serving.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Optional

import torch

from ps.server.checks import RequestChecks
from ps.spec.consistency import Async, Consistency
from ps.spec.counting import COUNT_KEY, counted_tables
from ps.server.contexts import Contexts
from ps.server.delta import export_state
from ps.server.gradients import StepGradients
from ps.server.hashed.serving import HashedTables
from ps.spec.messages import Mark, ShardInfo
from ps.server.metrics import PsMetrics
from ps.server.moves import Gate, Staged
from ps.server.refusals import Refusals
from ps.server.replica_writes import ReplicaWrites
from ps.spec.sharding import Columns, Layout, Slots, placement_of
from ps.spec.model import ModelSpec
from ps.server.state import Gathered, gather_shard, initial_shard
from ps.spec.surface import PsSurface
from ps.server.tables import ShardParams
from ps.server.update import SharedOptimizer, SyncSteps
from ps.server.work import Work
from services.errors import BadRequest
from services.remote import remote

log = logging.getLogger(__name__)

UNGATED = ("info", "layout_now")   # what may be asked while a change of layout rebuilds the shard


class ParameterServer(PsSurface):
    def __init__(self, name: str, shard: int, slots: "Slots | int", spec: ModelSpec, metrics: PsMetrics,
                 restore: Optional[list[dict[str, Any]]] = None, consistency: Consistency = Async(),
                 max_ids: int = 65_536) -> None:
        """``shard``: its index among the servers of ``slots`` (the leader's layout; a number of
        servers: their first); ``restore``: a checkpoint's shard states (any layout) to start
        from; ``max_ids``: the most ids one request may name."""
        self.name, self.spec, self.metrics, self.max_ids = name, spec, metrics, max_ids
        self.consistency = consistency
        self.work = Work()
        self._call = threading.local()      # who calls, the epoch it planned with, the operation it runs
        self.refusals = Refusals(metrics)
        self.superseded = self.refusals.old_incarnation          # Service's hook: counted there
        self.contexts = Contexts()
        self.gate, self.staged = Gate(), Staged()       # a change of layout (``ps/server/moves.py``)
        build_shard(self, slots, shard, restore)

    @property
    def empty(self) -> bool:
        """Whether its layout gives it nothing: it joined beside a job, or was drained."""
        return self.shard >= self.layout.num_shards

    def param(self, name: str) -> torch.nn.Parameter:     # ``ShardParams``'s, for operations
        return self.params[name]

    def export_state(self, into: Optional[tuple] = None, since: Optional[int] = None) -> dict[str, Any]:
        """This shard for a checkpoint (``ps/server/delta.py``'s ``export_state``)."""
        return export_state(self, into, since)

    def _stepped(self, rows: int, seconds: float) -> None:
        self.metrics.optimizer_steps.inc()
        self.metrics.rows_updated.inc(rows)
        self.work.add("update", rows, seconds)

    # --- the RPC surface (what each does: ps/spec/surface.py) ----------------------------------------------
    @remote
    def info(self) -> ShardInfo:
        return shard_info(self)

    @remote
    def layout_now(self) -> Slots:
        return self.layout.slots

    @remote
    def parameters(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.params.names, self.optimizer.snapshot(self.optimizer.params)))

    @remote
    def lookup(self, param: str, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup_many({param: ids})[param]

    @remote
    def lookup_many(self, lookups: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.read_rows(lookups)[1]

    @remote
    def read_rows(self, lookups: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        total = self.checks.lookups(lookups)
        with self.optimizer.lock:  # rows are read whole, never mid-update
            started = time.perf_counter()
            steps = self.optimizer.steps
            rows = {param: self._rows_of(param, ids).to(self.params.wire[param]) for param, ids in lookups.items()}
            self.work.add("lookup", total, time.perf_counter() - started)
        self.metrics.rows_looked_up.inc(total)
        return steps, rows

    def _rows_of(self, param: str, ids: torch.Tensor) -> torch.Tensor:
        table = self.checks.table_of(param)
        if table in self.hashed:
            return self.hashed.read(table, param, ids, self.optimizer.steps,
                                    functools.partial(self.contexts.note_read, self._call.caller, param))
        return self.params.row_shard(param)(self.layout.plans[table].to_local(ids))

    def _current(self, context_id: int) -> Any:
        """``keep`` for ``SharedOptimizer.apply``: without the hashed rows whose ids lost them
        since the caller read them in ``context_id``."""
        known = self.contexts.get(self._call.caller, context_id)
        return self.hashed.keep_current(known.reads if known is not None else {})

    @remote
    def push(self, context_id: int, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
             dense: Optional[dict[str, torch.Tensor]] = None) -> None:
        self.gradients.push(self._call.caller, context_id, grads, dense)

    @remote
    def dense_params(self) -> dict[str, torch.Tensor]:
        self.checks.same_layout("dense_params")
        with self.optimizer.lock:
            return self.params.dense_copy()

    @remote
    def dense_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.replica.read_state()

    @remote
    def set_dense(self, weights: dict[str, torch.Tensor], step: int,
                  state: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> bool:
        return self.replica.write(weights, step, state)

    @remote
    def hold_rows(self, lookups: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        return self.replica.read_rows(lookups)

    @remote
    def return_rows(self, rows: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]],
                    step: int) -> bool:
        return self.replica.write_rows(rows, step)

    @remote
    def op(self, name: str, *args: Any) -> Any:
        operation = self.spec.ops.get(name)
        self.checks.same_layout(f"operation {name}")   # an operation works on this shard's whole partition
        if operation is None:
            raise BadRequest(f"no operation {name!r}; this model has {', '.join(self.spec.ops) or 'none'}")
        self._call.op = name
        return operation(self, *args)

    @remote
    def grad_sq_norm(self, context_id: int, rows: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None,
                     dense: Optional[dict[str, torch.Tensor]] = None) -> float:
        grads, _ = self.gradients.of(self._call.caller, context_id, rows, dense)
        sq = self.refusals.finite_sq_norm(grads, self._call.caller, f"update in context {context_id}")
        self.contexts.mark_checked(self._call.caller, context_id)
        return sq

    @remote
    def applied_mark(self, trainer: str) -> Optional[dict[str, Any]]:
        return self.optimizer.marks.of(trainer)

    @remote
    def apply(self, context_id: Optional[int], coef: float = 1.0, weights: bool = False,
              mark: Optional[Mark] = None, rows: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None,
              dense: Optional[dict[str, torch.Tensor]] = None,
              read_at: Optional[int] = None) -> Optional[dict[str, torch.Tensor]]:
        self.consistency.require(False, "apply one trainer's update")
        self.checks.coef(coef)
        if read_at is not None and read_at < 0:
            raise BadRequest(f"read_at must be the updates a server had made (>= 0), got {read_at}")
        grads, known = self.gradients.of(self._call.caller, context_id, rows, dense)
        if known is None or not known.checked:     # a caller that skipped the norm round
            self.refusals.finite_sq_norm(grads, self._call.caller, f"update in context {context_id}")
        if coef < 1.0:
            grads = {p: g * coef for p, g in grads.items()}
        before, left = self.optimizer.apply(grads, self._current(context_id),
                                           functools.partial(self.params.dense_copy, False) if weights else None,
                                           {self._call.caller: mark} if mark is not None else None)
        first_read = known.read_at if known is not None else read_at
        if first_read is not None:       # a read stamped by an incarnation before this one's restore: 0
            self.metrics.staleness.observe(max(0, before - first_read))
        return left

    # sync mode: the trainer hands over its step's gradients; the leader's step clock closes the step
    @remote
    def contribute(self, context_id: Optional[int], step: int,
                   rows: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None,
                   dense: Optional[dict[str, torch.Tensor]] = None, mark: Optional[Mark] = None) -> None:
        self.consistency.require(True, "hand over gradients")
        grads, _ = self.gradients.of(self._call.caller, context_id, rows, dense)
        self.refusals.finite_sq_norm(grads, self._call.caller, f"gradients for step {step}")
        with self.optimizer.lock:
            grads = self._current(context_id)(grads)
        self.sync.contribute(step, self._call.caller, grads, mark)

    @remote
    def sync_sq_norm(self, step: int, trainers: list[str]) -> float:
        self.consistency.require(True, "average gradients")
        return self.sync.sq_norm(step, tuple(trainers))

    @remote
    def sync_apply(self, step: int, trainers: list[str], coef: float) -> None:
        self.consistency.require(True, "apply a step")
        self.checks.coef(coef)
        self.sync.apply(step, tuple(trainers), coef)
        for _ in trainers:
            self.metrics.staleness.observe(0)    # each read the parameters this update changes

    # --- for operations ------------------------------------------------------------------------------
    def snapshot(self, names: list[str]) -> list[torch.Tensor]:
        """Consistent private copies of these parameters: other trainers' updates change the live
        ones in place, so anything saved for a backward must be a copy."""
        return self.optimizer.snapshot([self.param(n) for n in names])

    # --- bookkeeping ---------------------------------------------------------------------------------
    def before_call(self, caller: str, method: str, version: int = 0) -> None:
        if method not in UNGATED:
            self.gate.enter()       # no request is inside while the tables are rebuilt
        self._call.caller, self._call.op, self._call.epoch = caller, None, version
        self.contexts.remember(caller, self.optimizer.steps)

    def after_call(self, method: str, seconds: float, ok: bool) -> None:
        if method not in UNGATED:
            self.gate.leave()
        # An operation is timed under its own name, as each was a method of its own.
        self.metrics.observe_request(getattr(self._call, "op", None) or method, seconds, ok)


def shard_info(server: ParameterServer) -> ShardInfo:
    """What ``server`` says of its shard to its clients (``PsSurface.info``)."""
    layout, shard = server.layout, server.shard
    return ShardInfo(server.name, shard, layout.num_shards, server.spec.meta,
                     {t: p.held(shard) for t, p in layout.plans.items()}, dict(layout.table_params),
                     tuple(layout.dense_of(shard)), server.optimizer.steps, str(server.consistency),
                     {t: placement_of(p) for t, p in layout.plans.items()}, server.checks.max_ids,
                     {n: tuple(server.params[n].shape[1:]) for n in layout.row_params()},
                     layout.epoch, {t: p.num_ids for t, p in layout.plans.items()},
                     tuple(counted_tables(server.spec)))


def build_shard(server: ParameterServer, slots: "Slots | int", shard: int,
                restore: Optional[list[dict[str, Any]]], gathered: Optional[Gathered] = None,
                columns: Optional[Columns] = None) -> None:
    """What ``server`` holds under the layout ``slots`` as shard ``shard``, and all that depends on
    it: fresh, from shard states (``gather_shard``), or as ``gathered`` already (a change of
    layout's, by ``columns``: None, the first). Rebuilt behind the server's gate when its layout
    changes."""
    spec = server.spec
    layout = Layout.of(spec, slots, columns)
    # All that can fail comes first: a rebuild that fails changes nothing.
    if gathered is not None:
        values, optim_state, steps, kept, marks = gathered
    elif restore is None:
        values, optim_state, steps, kept, marks = initial_shard(spec, layout, shard), {}, 0, {}, {}
    else:
        values, optim_state, steps, kept, marks = gather_shard(restore, layout, shard)
    server.layout, server.shard = layout, shard
    server.checks = RequestChecks(layout, shard, server.max_ids, lambda: getattr(server._call, "epoch", 0),
                                  server.refusals.stale_layout)
    server.params = params = ShardParams(spec, layout, shard, values)
    server.optimizer = SharedOptimizer([params[n] for n in params.names], params.rules, spec.lr,
                                       on_step=server._stepped, touched=params.touched.updated)
    if not counted_tables(spec):    # restored from a counting job's checkpoint: rows' counts left behind
        optim_state = {n: {k: v for k, v in s.items() if k != COUNT_KEY} for n, s in optim_state.items()}
    server.optimizer.load_state(steps, [optim_state.get(n, {}) for n in params.names], marks)
    server.sync = SyncSteps(server.optimizer)
    server.hashed = HashedTables(spec, layout, shard, params.of_tables(layout.hashed_tables()),
                                 server.optimizer.clear_rows, params.touched)
    server.hashed.restore(kept)
    server.gradients = StepGradients(params, server.checks, server.contexts, lambda: server.optimizer.steps)
    before = getattr(server, "replica", None)       # a rebuild keeps its order of replica writes
    server.replica = ReplicaWrites(params, server.optimizer, server.checks, before.step if before else -1)
