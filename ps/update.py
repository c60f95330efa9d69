"""The update rule: how a server applies trainers' gradients to its parameters.

Today's rule is asynchronous: each trainer's step is applied as it arrives, one at a time, by one
optimizer per server process shared by every trainer (``ps/service.py``'s ``ServerOptimizer``
forwards each trainer's step to it), under the lock that also orders parameter reads. The trainer's
side of a step (backward, clipping, the step itself) is ``ps/stub.py``'s ``StepSession``."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, Optional

import torch


def make_optimizer(kind: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    # Both accept sparse embedding gradients; Adam's fused kernels do not.
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adagrad":
        # Adagrad fills its state for every parameter up front (a shard's worth of memory, 0.3 s per
        # 512 MB), which a restore would throw away; added as a group, each parameter's state is
        # made at its first step instead, with the same values (Adagrad._init_group).
        optimizer = torch.optim.Adagrad([{"params": []}], lr=lr)
        optimizer.add_param_group({"params": params})
        del optimizer.param_groups[0]
        return optimizer
    raise ValueError(f"unknown optimizer {kind!r}")


def grad_sq_norm(grads: list[torch.Tensor]) -> float:
    total = 0.0
    for g in grads:
        values = g.coalesce().values() if g.is_sparse else g
        total += float(values.pow(2).sum())
    return total


class SharedOptimizer:
    """The server's optimizer and the lock that orders its steps against parameter reads."""

    def __init__(self, params: list[torch.nn.Parameter], kind: str, lr: float,
                 on_step: Optional[Callable[[int], None]] = None) -> None:
        self.lock = threading.Lock()
        self.params = params
        self.optimizer = make_optimizer(kind, params, lr)
        self._on_step = on_step
        self.steps = 0  # updates applied: the cluster's step, the same on every server at a pause

    def step(self) -> None:
        with self.lock:
            rows = sum(p.grad._nnz() for p in self.params if p.grad is not None and p.grad.is_sparse)
            self.optimizer.step()
            self.steps += 1
            # A parameter this context did not touch must not see the previous context's gradient.
            for p in self.params:
                p.grad = None
        if self._on_step is not None:
            self._on_step(rows)

    def snapshot(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Consistent copies: never half-way through another trainer's update."""
        with self.lock:
            return [t.detach().clone() for t in tensors]

    def copy_buffers(self) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """Empty tensors shaped like the parameters and their state, their pages already touched.

        A fresh gigabyte costs its page faults on first write; taking them here, before the trainers
        are held, leaves only a memory copy for ``state_copy``.
        """
        with _all_cores():
            params = [torch.empty_like(p).zero_() for p in self.params]
            state = [{k: torch.empty_like(v).zero_() for k, v in self.optimizer.state.get(p, {}).items()
                      if isinstance(v, torch.Tensor)} for p in self.params]
        return params, state

    def state_copy(self, into: Optional[tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]] = None
                   ) -> tuple[int, list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """(steps, parameters, per-parameter optimizer state), all private copies, taken at once
        (into ``into`` from ``copy_buffers`` when given)."""
        buffers = into if into is not None else self.copy_buffers()
        with self.lock, _all_cores():
            for dst, p in zip(buffers[0], self.params):
                dst.copy_(p.detach())
            for dst, p in zip(buffers[1], self.params):
                for k, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        if k not in dst or dst[k].shape != v.shape:
                            dst[k] = torch.empty_like(v)  # state that appeared since the buffers were made
                        dst[k].copy_(v)
            return self.steps, buffers[0], buffers[1]

    def load_state(self, steps: int, state: list[dict[str, torch.Tensor]]) -> None:
        """Adopt (not copy) restored per-parameter state."""
        with self.lock:
            self.steps = steps
            for p, s in zip(self.params, state):
                if s:
                    self.optimizer.state[p] = dict(s)


@contextlib.contextmanager
def _all_cores() -> Iterator[None]:
    """Copy with every core: a checkpoint's snapshot runs while the trainers are held, so the
    cores are otherwise idle, and a fresh copy's cost is page faults, which cores take in parallel."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)
