"""The parameter server's RPC surface.

``ParameterServer`` hosts one shard of what a workload's ``ModelSpec`` declares: its rows of every
table, its dense groups, and the spec's named operations. Its ``@remote`` methods are the whole
remote interface; trainers reach them only through ``ps/stub.py``. Every input is validated (types
by ``services/remote.py``, ids and names here, an operation's own arguments by the operation): a
bad request raises ``BadRequest`` back to its caller and the server keeps serving.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Optional

import torch

from ps.consistency import Async, Consistency
from ps.hashed.serving import HashedTables
from ps.messages import ShardInfo
from ps.sharding import Layout, placement_of
from ps.spec import ModelSpec
from ps.checks import RequestChecks
from ps.contexts import Contexts, in_autograd_context
from ps.replica_writes import ReplicaWrites
from ps.state import export_shard, gather_shard, initial_shard
from ps.tables import RowShard
from ps.update import SharedOptimizer, SyncSteps, grad_sq_norm
from ps.work import Work
from services.errors import BadRequest, UpdateRefused
from ps.metrics import PsMetrics
from services.remote import Service, remote

log = logging.getLogger(__name__)


class ParameterServer(Service):
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
            values, optim_state, steps, kept = initial_shard(spec, self.layout, shard), {}, 0, {}
        else:
            values, optim_state, steps, kept = gather_shard(restore, self.layout, shard)
        self.rows = torch.nn.ModuleDict({n.replace(".", "/"): RowShard(values[n]) for n in self.layout.row_params()})
        self.dense = torch.nn.ParameterDict({n.replace(".", "/"): torch.nn.Parameter(values[n])
                                             for n in self.layout.dense_of(shard)})
        self.param_names = [*self.layout.row_params(), *self.layout.dense_of(shard)]
        self.optimizer = SharedOptimizer([self.param(n) for n in self.param_names],
                                         [spec.rule_of(self.layout.table_of(n) if n in self.layout.row_params() else None)
                                          for n in self.param_names], spec.lr, on_step=self._stepped)
        self.optimizer.load_state(steps, [optim_state.get(n, {}) for n in self.param_names])
        self.sync = SyncSteps(self.optimizer)
        self.hashed = HashedTables(spec, self.layout, shard, {n: self.param(n) for t in self.layout.hashed_tables()
                                                               for n in self.layout.table_params[t]},
                                   self.optimizer.clear_rows)
        self.hashed.restore(kept)
        self.contexts = Contexts()
        self.replica = ReplicaWrites({n: self.param(n) for n in self.layout.dense_of(shard)}, self.optimizer)
        self._call = threading.local()      # who calls, and the operation it runs (its metrics label)
        self._refused_lock = threading.Lock()
        self.refused = 0                    # updates refused whole (under _refused_lock)

    def param(self, name: str) -> torch.nn.Parameter:
        """The live parameter ``name`` (a table's rows on this shard, or a dense tensor)."""
        key = name.replace(".", "/")   # module and parameter dicts take no dots in keys
        if key in self.rows:
            return self.rows[key].weight
        return self.dense[key]

    def export_state(self, into: Optional[tuple] = None) -> dict[str, Any]:
        """This shard for a checkpoint: parameters, optimizer state and step, copied at one instant
        (into buffers from ``self.optimizer.copy_buffers()`` when given)."""
        with self.optimizer.lock:
            # A checkpoint is when hashed tables' rows unseen for long are evicted (trainers are held).
            self.hashed.expire(self.optimizer.steps)
            kept = self.hashed.snapshot()
        steps, params, state = self.optimizer.state_copy(into)
        return export_shard(self.shard, self.layout, self.spec.meta, steps, dict(zip(self.param_names, params)),
                            {n: s for n, s in zip(self.param_names, state) if s}, kept)

    def _stepped(self, rows: int, seconds: float) -> None:
        self.metrics.optimizer_steps.inc()
        self.metrics.rows_updated.inc(rows)
        self.work.add("update", rows, seconds)

    # --- the RPC surface ---------------------------------------------------------------------------
    @remote
    def info(self) -> ShardInfo:
        return ShardInfo(self.name, self.shard, self.layout.num_shards, self.spec.meta,
                         {t: p.rows(self.shard) for t, p in self.layout.plans.items()}, dict(self.layout.table_params),
                         tuple(self.layout.dense_of(self.shard)), self.optimizer.steps, str(self.consistency),
                         {t: placement_of(p) for t, p in self.layout.plans.items()})

    @remote
    def parameters(self) -> dict[str, torch.Tensor]:
        """A consistent copy of every parameter this shard holds (no autograd history). For tests:
        they compare a cluster's parameters with a one-process model's; trainers never call it."""
        return dict(zip(self.param_names, self.optimizer.snapshot(self.optimizer.params)))

    @remote
    def lookup(self, param: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows [n, *row shape] of table parameter ``param`` at global ``ids`` [n] this shard owns."""
        return self.lookup_many({param: ids})[param]

    @remote
    def lookup_many(self, lookups: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of several table parameters at once (parameter -> global ``ids`` [n] this shard
        owns; each answer [n, *row shape]): a step's every table in one request. At most
        ``--max-ids-per-request`` ids in all."""
        if not lookups:
            raise BadRequest("lookup_many names no parameter")
        total = 0
        for param, ids in lookups.items():
            self.checks.ids(self.checks.table_of(param), ids, "ids" if len(lookups) == 1 else f"ids of {param}")
            total += ids.numel()
        self.checks.count(total, "the lookups")
        with self.optimizer.lock:  # rows are read whole, never mid-update
            started = time.perf_counter()
            rows = {param: self._rows_of(param, ids) for param, ids in lookups.items()}
            self.work.add("lookup", total, time.perf_counter() - started)
        self.metrics.rows_looked_up.inc(total)
        return rows

    def _rows_of(self, param: str, ids: torch.Tensor) -> torch.Tensor:
        table = self.checks.table_of(param)
        if table not in self.hashed:
            return self.rows[param.replace(".", "/")](self.layout.plans[table].to_local(ids))
        # Only a training step's read admits, evicts and counts: an evaluation changes nothing.
        training = in_autograd_context()
        found, read = self.hashed.lookup(table, param, ids, self.optimizer.steps, training)
        if training:
            self.contexts.note_read(self._call.caller, param, read)
        return found

    def _current(self, context_id: int) -> Any:
        """``keep`` for ``SharedOptimizer.apply``: the caller's gradients in ``context_id``
        without the hashed rows whose ids lost them since it read them."""
        known = self.contexts.get(self._call.caller, context_id)
        reads = known.reads if known is not None else {}
        return lambda grads: self.hashed.current(grads, reads) if reads else grads

    @remote
    def dense_params(self) -> dict[str, torch.Tensor]:
        """This shard's dense tensors; computing with them records the way back for gradients."""
        names = self.layout.dense_of(self.shard)
        with self.optimizer.lock:
            return {n: self.param(n).clone() for n in names}

    @remote
    def dense_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's state of this shard's dense tensors (name -> its state; none for SGD)."""
        with self.optimizer.lock:
            states = {n: self.optimizer.state_of(self.param(n)) for n in self.layout.dense_of(self.shard)}
        return {n: state for n, state in states.items() if state}

    @remote
    def set_dense(self, weights: dict[str, torch.Tensor], step: int,
                  state: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> bool:
        """The trainers' replica of the dense weights as of ``step`` (``ps/replica_writes.py``)."""
        return self.replica.write(weights, step, state)

    @remote
    def op(self, name: str, *args: Any) -> Any:
        """The model's server-side operation ``name`` on this shard."""
        operation = self.spec.ops.get(name)
        if operation is None:
            raise BadRequest(f"no operation {name!r}; this model has {', '.join(self.spec.ops) or 'none'}")
        self._call.op = name
        return operation(self, *args)

    @remote
    def grad_sq_norm(self, context_id: int) -> float:
        """The squared norm of the caller's gradients here: the first half of an async or ssp
        update, where gradients that are not finite are refused before any server applies any."""
        sq = self._finite_sq_norm(self.contexts.grads(context_id), f"update in context {context_id}")
        self.contexts.mark_checked(self._call.caller, context_id)
        return sq

    @remote
    def scale_grads(self, context_id: int, coef: float) -> None:
        if not (0.0 <= coef <= 1.0):
            raise BadRequest(f"coef must be a float in [0, 1], got {coef!r}")
        for g in self.contexts.grads(context_id).values():
            g.mul_(coef)  # the very tensors ``apply`` will apply

    @remote
    def apply(self, context_id: int) -> None:
        """async and ssp modes: apply the caller's gradients in ``context_id`` now, all or none."""
        self._require(False, "apply one trainer's update")
        grads = self.contexts.grads(context_id)
        known = self.contexts.get(self._call.caller, context_id)
        if known is None or not known.checked:     # a caller that skipped the norm round
            self._finite_sq_norm(grads, f"update in context {context_id}")
        before = self.optimizer.apply(grads, self._current(context_id))
        if known is not None:
            self.metrics.staleness.observe(before - known.read_at)

    # sync mode: the trainer hands over its step's gradients; the leader's step clock closes the step
    @remote
    def contribute(self, context_id: int, step: int) -> None:
        """The caller's gradients in ``context_id``, for step ``step`` (the open one)."""
        self._require(True, "hand over gradients")
        grads = self.contexts.grads(context_id)
        self._finite_sq_norm(grads, f"gradients for step {step}")
        with self.optimizer.lock:
            grads = self._current(context_id)(grads)
        self.sync.contribute(step, self._call.caller, grads)

    @remote
    def sync_sq_norm(self, step: int, trainers: list[str]) -> float:
        self._require(True, "average gradients")
        return self.sync.sq_norm(step, tuple(trainers))

    @remote
    def sync_apply(self, step: int, trainers: list[str], coef: float) -> None:
        """Apply step ``step``: the average of ``trainers``' gradients, scaled by ``coef``."""
        self._require(True, "apply a step")
        if not (0.0 <= coef <= 1.0):
            raise BadRequest(f"coef must be a float in [0, 1], got {coef!r}")
        self.sync.apply(step, tuple(trainers), coef)
        for _ in trainers:
            self.metrics.staleness.observe(0)    # each read the parameters this update changes

    def _finite_sq_norm(self, grads: dict[torch.Tensor, torch.Tensor], what: str) -> float:
        """The gradients' squared norm, or ``UpdateRefused``: one bad trainer must not poison the
        shared model. A NaN or inf anywhere makes the sum so, which saves a pass of its own."""
        sq = grad_sq_norm(list(grads.values()))
        if math.isfinite(sq):
            return sq
        with self._refused_lock:
            self.refused += 1
        self.metrics.updates_refused.inc()
        raise UpdateRefused(f"{self._call.caller}'s {what} is not finite; nothing of it was applied")

    def _require(self, averaged: bool, what: str) -> None:
        """Refuse a call of the other kind of update: a sync job's steps are averaged at the step
        clock; an async or ssp job's are each trainer's own."""
        if self.consistency.averaged != averaged:
            raise BadRequest(f"cannot {what}: this job's consistency is {self.consistency}")

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
