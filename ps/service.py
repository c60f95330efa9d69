"""The parameter server's RPC surface.

``ParameterServer`` hosts one shard of what a workload's ``ModelSpec`` declares: its rows of every
table, its dense groups, and the spec's named operations. Its ``@remote`` methods are the whole
remote interface; trainers reach them only through ``ps/stub.py``. Every input is validated (types
by ``services/remote.py``, ids and names here, an operation's own arguments by the operation): a
bad request raises ``BadRequest`` back to its caller and the server keeps serving.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed.autograd as dist_autograd

from ps.consistency import Consistency
from ps.messages import ShardInfo
from ps.sharding import Layout, placement_of
from ps.spec import ModelSpec
from ps.state import export_shard, gather_shard
from ps.tables import RowShard
from ps.update import SharedOptimizer, SyncSteps, grad_sq_norm
from services.errors import BadRequest, UpdateRefused
from ps.metrics import PsMetrics
from services.remote import Service, remote

log = logging.getLogger(__name__)

INIT_ROWS = 1 << 20  # rows of a table initialised at once
_CONTEXTS_KEPT = 4  # a trainer has at most one or two contexts open; older ones it released itself


@dataclass
class _Context:
    """What the server knows of one of a trainer's steps (its distributed autograd context)."""

    read_at: int             # the server's step when the trainer first read in it
    checked: bool = False    # its gradients' norm was taken, so they are known to be finite


class ParameterServer(Service):
    def __init__(self, name: str, shard: int, num_shards: int, spec: ModelSpec, metrics: PsMetrics,
                 restore: Optional[list[dict[str, Any]]] = None, consistency: Consistency = Consistency(),
                 max_ids: int = 65_536) -> None:
        """``restore``: the shard states of a checkpoint (any number of shards) to start from;
        ``max_ids``: the most ids one request may name."""
        self.name, self.shard, self.spec, self.metrics = name, shard, spec, metrics
        self.consistency, self.max_ids = consistency, max_ids
        self.layout = Layout.of(spec, num_shards)
        if restore is None:
            values, optim_state, steps = self._initial_values(), {}, 0
        else:
            values, optim_state, steps = gather_shard(restore, self.layout, shard)
        self.rows = torch.nn.ModuleDict({n.replace(".", "/"): RowShard(values[n]) for n in self.layout.row_params()})
        self.dense = torch.nn.ParameterDict({n.replace(".", "/"): torch.nn.Parameter(values[n])
                                             for n in self.layout.dense_of(shard)})
        self.param_names = [*self.layout.row_params(), *self.layout.dense_of(shard)]
        self.optimizer = SharedOptimizer([self.param(n) for n in self.param_names],
                                         [spec.rule_of(self.layout.table_of(n) if n in self.layout.row_params() else None)
                                          for n in self.param_names], spec.lr, on_step=self._stepped)
        self.optimizer.load_state(steps, [optim_state.get(n, {}) for n in self.param_names])
        self.sync = SyncSteps(self.optimizer)
        self._contexts: dict[str, collections.OrderedDict[int, _Context]] = {}   # caller -> its recent steps
        self._contexts_lock = threading.Lock()
        self._call = threading.local()      # who calls, and the operation it runs (its metrics label)
        self.refused = 0                    # updates refused whole (under _contexts_lock)
        self._replica_step = -1             # the step of the trainers' replica last written (under optimizer.lock)

    def _initial_values(self) -> dict[str, torch.Tensor]:
        values: dict[str, torch.Tensor] = {}
        for table_name, table in self.spec.tables.items():
            rows = self.layout.plans[table_name].global_ids(self.shard)
            for name, shape in table.params.items():
                values[name] = torch.empty(len(rows), *shape)
            for start in range(0, len(rows), INIT_ROWS):       # a slice at a time: bounded temporaries
                part = table.init(rows[start:start + INIT_ROWS])
                for name in table.params:
                    values[name][start:start + len(part[name])] = part[name]
        for g in self.layout.groups_of(self.shard):
            values.update(self.spec.dense[g].init())
        return values

    def param(self, name: str) -> torch.nn.Parameter:
        """The live parameter ``name`` (a table's rows on this shard, or a dense tensor)."""
        key = name.replace(".", "/")   # module and parameter dicts take no dots in keys
        if key in self.rows:
            return self.rows[key].weight
        return self.dense[key]

    def export_state(self, into: Optional[tuple] = None) -> dict[str, Any]:
        """This shard for a checkpoint: parameters, optimizer state and step, copied at one instant
        (into buffers from ``self.optimizer.copy_buffers()`` when given)."""
        steps, params, state = self.optimizer.state_copy(into)
        return export_shard(self.shard, self.layout, self.spec.meta, steps, dict(zip(self.param_names, params)),
                            {n: s for n, s in zip(self.param_names, state) if s})

    def _stepped(self, rows: int) -> None:
        self.metrics.optimizer_steps.inc()
        self.metrics.rows_updated.inc(rows)

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
            self.check_ids(self._table_of(param), ids, "ids" if len(lookups) == 1 else f"ids of {param}")
            total += ids.numel()
        if total > self.max_ids:
            raise BadRequest(f"the lookups name {total} ids, more than the {self.max_ids} one request may "
                             f"(--max-ids-per-request): split them")
        with self.optimizer.lock:  # rows are read whole, never mid-update
            rows = {param: self.rows[param.replace(".", "/")](self.layout.plans[self._table_of(param)].to_local(ids))
                    for param, ids in lookups.items()}
        self.metrics.rows_looked_up.inc(total)
        return rows

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
        """Take this shard's dense tensors from ``weights``, and their optimizer state from
        ``state`` (both may hold other shards' too): the trainers' replica (``--dense allreduce``)
        as of the step clock's ``step``, written here so a checkpoint holds it once. Every trainer
        of the group writes its own; replicas of one step are equal, and one of an older step (a
        trainer whose last step failed) never overwrites a newer one. Whether it was taken."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise BadRequest(f"set_dense: step must be an int >= 0, got {step!r}")
        names = self.layout.dense_of(self.shard)
        states = self._dense_states(names, state or {})
        missing = [n for n in names if n not in weights]
        if missing:
            raise BadRequest(f"set_dense: no value for {', '.join(missing)}")
        for n in names:
            value = weights[n]
            if not isinstance(value, torch.Tensor) or value.shape != self.param(n).shape or value.dtype != self.param(n).dtype:
                raise BadRequest(f"set_dense: {n} must be a {self.param(n).dtype} tensor {list(self.param(n).shape)}, "
                                 f"got {describe(value)}")
            if not bool(torch.isfinite(value).all()):
                raise BadRequest(f"set_dense: {n} is not finite")
        with self.optimizer.lock, torch.no_grad():
            if step < self._replica_step:
                return False
            self._replica_step = step
            for n in names:
                self.param(n).copy_(weights[n])
            for n, values in states.items():
                self.optimizer.set_state(self.param(n), values)
        return True

    def _dense_states(self, names: list[str], state: Any) -> dict[str, dict[str, torch.Tensor]]:
        """``set_dense``'s optimizer state for ``names``, checked: per tensor, a dict of finite
        floating tensors shaped like it or holding one value (a step count)."""
        if not isinstance(state, dict):
            raise BadRequest(f"set_dense: state must be a dict of tensor name -> its state, got {describe(state)}")
        out = {}
        for n in names:
            values = state.get(n)
            if values is None:
                continue
            ok = isinstance(values, dict) and all(
                isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point()
                and (v.shape == self.param(n).shape or v.numel() == 1) for k, v in values.items())
            if not ok:
                raise BadRequest(f"set_dense: the state of {n} must map names to float tensors "
                                 f"{list(self.param(n).shape)} or single values, got {describe(values)}")
            if not all(bool(torch.isfinite(v).all()) for v in values.values()):
                raise BadRequest(f"set_dense: the state of {n} is not finite")
            out[n] = {k: v.clone() for k, v in values.items()}
        return out

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
        sq = self._finite_sq_norm(self._context_grads(context_id), f"update in context {context_id}")
        with self._contexts_lock:
            known = self._contexts.get(self._call.caller, {}).get(context_id)
            if known is not None:
                known.checked = True
        return sq

    @remote
    def scale_grads(self, context_id: int, coef: float) -> None:
        if not (0.0 <= coef <= 1.0):
            raise BadRequest(f"coef must be a float in [0, 1], got {coef!r}")
        for g in self._context_grads(context_id).values():
            g.mul_(coef)  # the very tensors ``apply`` will apply

    @remote
    def apply(self, context_id: int) -> None:
        """async and ssp modes: apply the caller's gradients in ``context_id`` now, all or none."""
        self._require_not("sync", "apply one trainer's update")
        grads = self._context_grads(context_id)
        with self._contexts_lock:
            known = self._contexts.get(self._call.caller, {}).get(context_id)
        if known is None or not known.checked:     # a caller that skipped the norm round
            self._finite_sq_norm(grads, f"update in context {context_id}")
        before = self.optimizer.apply(grads)
        if known is not None:
            self.metrics.staleness.observe(before - known.read_at)

    # sync mode: the trainer hands over its step's gradients; the leader's step clock closes the step
    @remote
    def contribute(self, context_id: int, step: int) -> None:
        """The caller's gradients in ``context_id``, for step ``step`` (the open one)."""
        self._require("sync", "hand over gradients")
        grads = self._context_grads(context_id)
        self._finite_sq_norm(grads, f"gradients for step {step}")
        self.sync.contribute(step, self._call.caller, grads)

    @remote
    def sync_sq_norm(self, step: int, trainers: list[str]) -> float:
        self._require("sync", "average gradients")
        return self.sync.sq_norm(step, tuple(trainers))

    @remote
    def sync_apply(self, step: int, trainers: list[str], coef: float) -> None:
        """Apply step ``step``: the average of ``trainers``' gradients, scaled by ``coef``."""
        self._require("sync", "apply a step")
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
        with self._contexts_lock:
            self.refused += 1
        self.metrics.updates_refused.inc()
        raise UpdateRefused(f"{self._call.caller}'s {what} is not finite; nothing of it was applied")

    def _require_not(self, kind: str, what: str) -> None:
        if self.consistency.kind == kind:
            raise BadRequest(f"cannot {what}: this job's consistency is {kind}")

    def _require(self, kind: str, what: str) -> None:
        if self.consistency.kind != kind:
            raise BadRequest(f"cannot {what}: this job's consistency is {self.consistency}, not {kind}")

    # --- for operations ------------------------------------------------------------------------------
    def snapshot(self, names: list[str]) -> list[torch.Tensor]:
        """Consistent private copies of these parameters: other trainers' updates change the live
        ones in place, so anything saved for a backward must be a copy."""
        return self.optimizer.snapshot([self.param(n) for n in names])

    def check_ids(self, table: str, ids: Any, what: str, any_shard: bool = False) -> None:
        plan = self.layout.plans[table]
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise BadRequest(f"{what} must be an int64 tensor [n], got {describe(ids)}")
        if ids.numel() == 0:
            raise BadRequest(f"{what} is empty")
        if ids.numel() > self.max_ids:
            raise BadRequest(f"{what} names {ids.numel()} ids, more than the {self.max_ids} one request may "
                             f"(--max-ids-per-request): split it")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= plan.num_ids:
            raise BadRequest(f"{what} out of range: [{lo}, {hi}] not within [0, {plan.num_ids})")
        if not any_shard and bool((plan.owner(ids) != self.shard).any()):
            raise BadRequest(f"{what} holds ids that shard {self.shard} of {plan.num_shards} does not own")

    # --- bookkeeping ---------------------------------------------------------------------------------
    def before_call(self, caller: str, method: str) -> None:
        self._call.caller, self._call.op = caller, None
        self._remember_context(caller)

    def after_call(self, method: str, seconds: float, ok: bool) -> None:
        # An operation is timed under its own name, as each was a method of its own.
        self.metrics.observe_request(getattr(self._call, "op", None) or method, seconds, ok)

    def _table_of(self, param: str) -> str:
        try:
            return self.layout.table_of(param)
        except KeyError:
            raise BadRequest(f"no table parameter {param!r}; this model has {', '.join(self.layout.row_params())}") from None

    def _remember_context(self, caller: str) -> None:
        if not in_autograd_context():
            return
        context_id = dist_autograd._current_context()._context_id()
        with self._contexts_lock:
            recent = self._contexts.setdefault(caller, collections.OrderedDict())
            if context_id not in recent:
                recent[context_id] = _Context(self.optimizer.steps)
                while len(recent) > _CONTEXTS_KEPT:
                    recent.popitem(last=False)

    def forget(self, caller: str) -> None:
        """Free what a departed trainer left behind (its autograd contexts would otherwise leak)."""
        with self._contexts_lock:
            ids = list(self._contexts.pop(caller, ()))
        released = 0
        for context_id in ids:
            try:
                dist_autograd._release_context(context_id)
                released += 1
            except Exception:
                pass  # already released by the trainer itself
        if released:
            log.info("released %d autograd context(s) left by %s", released, caller)

    def _context_grads(self, context_id: int) -> dict:
        try:
            return dist_autograd.get_gradients(context_id)
        except RuntimeError as exc:
            raise BadRequest(f"unknown autograd context {context_id}: {str(exc).splitlines()[0]}") from None


def in_autograd_context() -> bool:
    try:
        dist_autograd._current_context()
        return True
    except RuntimeError:
        return False


def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor {list(x.shape)}"
    return type(x).__name__

