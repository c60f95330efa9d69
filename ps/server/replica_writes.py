"""Where the trainers' replica of the dense weights (``--dense allreduce``) is written to the
servers, so a checkpoint holds it once. Every trainer of the group writes its own; replicas of one
step are equal, and one of an older step (a trainer whose last step failed) never overwrites a
newer one. Everything written is checked first: shapes, dtypes, finiteness."""
from __future__ import annotations

from typing import Any

import torch

from ps.server.update import SharedOptimizer
from services.errors import BadRequest
from services.remote import describe


class ReplicaWrites:
    def __init__(self, params: dict[str, torch.nn.Parameter], optimizer: SharedOptimizer) -> None:
        """``params``: this shard's dense tensors by name."""
        self.params, self.optimizer = params, optimizer
        self._step = -1          # the step of the replica last written (under optimizer.lock)

    def write(self, weights: Any, step: Any, state: Any) -> bool:
        """Take the tensors from ``weights`` and their optimizer state from ``state`` (both may
        hold other shards' too), as of the step clock's ``step``. Whether it was taken."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise BadRequest(f"set_dense: step must be an int >= 0, got {step!r}")
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
