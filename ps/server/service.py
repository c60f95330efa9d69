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
from ps.server.contexts import Contexts
from ps.server.delta import export_state
from ps.server.gradients import StepGradients
from ps.server.hashed.serving import HashedTables
from ps.spec.messages import Mark, ShardInfo
from ps.server.metrics import PsMetrics
from ps.server.refusals import Refusals
from ps.server.replica_writes import ReplicaWrites
from ps.spec.sharding import Layout, placement_of
from ps.spec.model import ModelSpec
from ps.server.state import gather_shard, initial_shard
from ps.spec.surface import PsSurface
from ps.server.tables import ShardParams
from ps.server.update import SharedOptimizer, SyncSteps
from ps.server.work import Work
from services.errors import BadRequest
from services.remote import remote

log = logging.getLogger(__name__)


class ParameterServer(PsSurface):
    def __init__(self, name: str, shard: int, num_shards: int, spec: ModelSpec, metrics: PsMetrics,
                 restore: Optional[list[dict[str, Any]]] = None, consistency: Consistency = Async(),
                 max_ids: int = 65_536) -> None:
        """``restore``: the shard states of a checkpoint (any number of shards) to start from;
        ``max_ids``: the most ids one request may name."""
        self.name, self.shard, self.spec, self.metrics = name, shard, spec, metrics
        self.consistency = consistency
        self.work = Work()
        self.layout = Layout.of(spec, num_shards)
        self.checks = RequestChecks(self.layout, shard, max_ids)
        if restore is None:
            values, optim_state, steps, kept, marks = initial_shard(spec, self.layout, shard), {}, 0, {}, {}
        else:
            values, optim_state, steps, kept, marks = gather_shard(restore, self.layout, shard)
        self.params = ShardParams(spec, self.layout, shard, values)
        self.optimizer = SharedOptimizer([self.param(n) for n in self.params.names], self.params.rules, spec.lr,
                                         on_step=self._stepped, touched=self.params.touched.updated)
        self.optimizer.load_state(steps, [optim_state.get(n, {}) for n in self.params.names], marks)
        self.sync = SyncSteps(self.optimizer)
        self.hashed = HashedTables(spec, self.layout, shard, self.params.of_tables(self.layout.hashed_tables()),
                                   self.optimizer.clear_rows, self.params.touched)
        self.hashed.restore(kept)
        self.contexts = Contexts()
        self.gradients = StepGradients(self.params, self.checks, self.contexts, lambda: self.optimizer.steps)
        self.replica = ReplicaWrites(self.params, self.optimizer, self.checks)
        self._call = threading.local()      # who calls, and the operation it runs (its metrics label)
        self.refusals = Refusals(metrics)
        self.superseded = self.refusals.old_incarnation          # Service's hook: counted there

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
        return ShardInfo(self.name, self.shard, self.layout.num_shards, self.spec.meta,
                         {t: p.rows(self.shard) for t, p in self.layout.plans.items()}, dict(self.layout.table_params),
                         tuple(self.layout.dense_of(self.shard)), self.optimizer.steps, str(self.consistency),
                         {t: placement_of(p) for t, p in self.layout.plans.items()}, self.checks.max_ids,
                         {n: tuple(self.params[n].shape[1:]) for n in self.layout.row_params()})

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
    def before_call(self, caller: str, method: str) -> None:
        self._call.caller, self._call.op = caller, None
        self.contexts.remember(caller, self.optimizer.steps)

    def after_call(self, method: str, seconds: float, ok: bool) -> None:
        # An operation is timed under its own name, as each was a method of its own.
        self.metrics.observe_request(getattr(self._call, "op", None) or method, seconds, ok)
