"""Where the trainers' replica (``--dense allreduce``) is written to the servers, so a checkpoint
holds it once: the dense weights, and the hot rows the trainers hold while they replicate them
(``--cache-staleness 0``, ``trainer/core/hot_rows.py``), which are also read from here, with their
optimizer state, when they go to the trainers. Every trainer of the group writes its own; replicas
of one step are equal, and one of an older step (a trainer whose last step failed) never
overwrites a newer one. Everything written is checked first: ids, shapes, dtypes, finiteness."""
from __future__ import annotations

from typing import Any

import torch

from ps.server.checks import RequestChecks
from ps.server.tables import ShardParams
from ps.server.update import SharedOptimizer
from services.errors import BadRequest
from services.remote import describe

RowsAndState = dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]     # param -> (rows, their state's rows)


class ReplicaWrites:
    def __init__(self, shard: ShardParams, optimizer: SharedOptimizer, checks: RequestChecks,
                 step: int = -1) -> None:
        """``step``: of the replica written last (the shard was rebuilt by a change of layout)."""
        self.shard, self.optimizer, self.checks = shard, optimizer, checks
        self.params = {n: shard[n] for n in shard.dense_names}       # this shard's dense tensors by name
        self._rules = dict(zip(shard.names, shard.rules))
        self._step = step        # the step of the replica last written (under optimizer.lock)

    @property
    def step(self) -> int:
        return self._step

    def write(self, weights: Any, step: Any, state: Any) -> bool:
        """Take the tensors from ``weights`` and their optimizer state from ``state`` (both may
        hold other shards' too), as of the step clock's ``step``. Whether it was taken."""
        self._check_step(step, "set_dense")
        states = self._checked_states(state or {})
        missing = [n for n in self.params if n not in weights]
        if missing:
            raise BadRequest(f"set_dense: no value for {', '.join(missing)}")
        for n, param in self.params.items():
            value = weights[n]
            if not isinstance(value, torch.Tensor) or value.shape != param.shape or value.dtype != param.dtype:
                raise BadRequest(f"set_dense: {n} must be a {param.dtype} tensor {list(param.shape)}, "
                                 f"got {describe(value)}")
            if not bool(torch.isfinite(value).all()):
                raise BadRequest(f"set_dense: {n} is not finite")
        with self.optimizer.lock, torch.no_grad():
            if step < self._step:
                return False
            self._step = step
            for n, param in self.params.items():
                param.copy_(weights[n])
            for n, values in states.items():
                self.optimizer.set_state(self.params[n], values)
        return True

    @staticmethod
    def _check_step(step: Any, what: str) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise BadRequest(f"{what}: step must be an int >= 0, got {step!r}")

    def _checked_states(self, state: Any) -> dict[str, dict[str, torch.Tensor]]:
        """Per tensor, a dict of finite floating tensors shaped like it or holding one value (a step count)."""
        if not isinstance(state, dict):
            raise BadRequest(f"set_dense: state must be a dict of tensor name -> its state, got {describe(state)}")
        out = {}
        for n, param in self.params.items():
            values = state.get(n)
            if values is None:
                continue
            ok = isinstance(values, dict) and all(
                isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point()
                and (v.shape == param.shape or v.numel() == 1) for k, v in values.items())
            if not ok:
                raise BadRequest(f"set_dense: the state of {n} must map names to float tensors "
                                 f"{list(param.shape)} or single values, got {describe(values)}")
            if not all(bool(torch.isfinite(v).all()) for v in values.values()):
                raise BadRequest(f"set_dense: the state of {n} is not finite")
            out[n] = {k: v.clone() for k, v in values.items()}
        return out

    def read_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's state of this shard's dense tensors (none for those without)."""
        with self.optimizer.lock:
            states = {n: self.optimizer.state_of(p) for n, p in self.params.items()}
        return {n: state for n, state in states.items() if state}

    def read_rows(self, lookups: Any) -> RowsAndState:
        """Rows of plain tables (parameter -> ids this shard owns) as fp32, with the rows of their
        optimizer state (zeros before the table's first step): what a trainer holds of them."""
        local = self._local(lookups, "hold_rows")
        with self.optimizer.lock, torch.no_grad():     # no way back: the trainers step these rows themselves
            return {param: (self.shard[param][at].float(),
                            {k: v[at].clone() for k, v in self._row_state(param).items()})
                    for param, at in local.items()}

    def write_rows(self, rows: Any, step: Any) -> bool:
        """Rows the trainers held (parameter -> (ids, values, their state's rows by name)), as of
        the step clock's ``step``: each row and its state as given. Whether they were taken."""
        self._check_step(step, "return_rows")
        if not isinstance(rows, dict) or not all(isinstance(v, tuple) and len(v) == 3 for v in rows.values()):
            raise BadRequest(f"return_rows: rows must map parameters to (ids, values, state), got {describe(rows)}")
        local = self._local({p: ids for p, (ids, _, _) in rows.items()}, "return_rows")
        for param, (ids, values, state) in rows.items():
            self._check_rows(param, ids.numel(), values, state)
        with self.optimizer.lock, torch.no_grad():
            if step < self._step:
                return False
            self._step = step
            for param, (_, values, state) in rows.items():
                weight, at = self.shard[param], local[param]
                weight[at] = values.to(weight.dtype)
                for k, v in self._row_state(param, make=True).items():
                    v[at] = state[k]
                self.shard.touched.read(self.checks.table_of(param), at)     # for the next delta checkpoint
        return True

    def _local(self, lookups: Any, what: str) -> dict[str, torch.Tensor]:
        if not isinstance(lookups, dict) or not lookups:
            raise BadRequest(f"{what}: name at least one table parameter and its ids, got {describe(lookups)}")
        return {param: self.checks.layout.plans[self.checks.held(param, ids, what)].to_local(ids.long())
                for param, ids in lookups.items()}

    def _row_state(self, param: str, make: bool = False) -> dict[str, torch.Tensor]:
        """The live rows of ``param``'s optimizer state, by name (zeros, not kept, before its
        first step, unless ``make``). Under optimizer.lock."""
        weight, rule = self.shard[param], self._rules[param]
        state = self.optimizer.live_state(weight)
        if not state:
            state = {k: torch.zeros(shape) for k, shape in rule.state_shapes(weight).items()}
            if make:
                self.optimizer.set_state(weight, state)
        return {k: state[k] for k in rule.row_state if k in state}

    def _check_rows(self, param: str, n: int, values: Any, state: Any) -> None:
        row = tuple(self.shard[param].shape[1:])
        if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.shape != (n, *row):
            raise BadRequest(f"return_rows: the rows of {param} must be a float tensor {[n, *row]}, "
                             f"got {describe(values)}")
        with self.optimizer.lock:
            shapes = {k: (n, *v.shape[1:]) for k, v in self._row_state(param).items()}
        if not isinstance(state, dict) or set(state) != set(shapes) or not all(
                isinstance(state[k], torch.Tensor) and state[k].is_floating_point() and state[k].shape == s
                for k, s in shapes.items()):
            raise BadRequest(f"return_rows: the state of {param}'s rows must map {sorted(shapes) or 'nothing'} to "
                             f"float tensors {list(shapes.values())}, got {describe(state)}")
        if not bool(torch.isfinite(values).all()) or not all(bool(torch.isfinite(v).all()) for v in state.values()):
            raise BadRequest(f"return_rows: the rows of {param} or their state are not finite")
