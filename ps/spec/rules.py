"""Update rules as objects: how one parameter's gradient changes it, chosen per table.

A rule steps one parameter in place with its gradient (dense, or sparse over rows: a table's step
touches only the rows a batch used) and keeps its own state, made at the parameter's first step:

* ``Sgd``: ``w -= lr * g``;
* ``Adagrad``: a running sum of squared gradients per value, as ``torch.optim.Adagrad`` (the same
  values, and the same state, ``step`` and ``sum``, so either reads the other's);
* ``RowWiseAdagrad``: one running sum per *row*, of the row gradient's mean square, as FBGEMM's
  ``EXACT_ROWWISE_ADAGRAD``: a table's optimizer state is 4 bytes a row instead of a row's size.

A table stored in half precision (``ps/spec/precision.py``) is stepped in fp32 and rounded back
stochastically; its optimizer state stays fp32. A workload may add its own rule: anything with
``name``, ``state_shapes`` and ``step``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ps.spec.precision import add_rows, is_half

EPS = 1e-10      # torch.optim.Adagrad's


class UpdateRule(Protocol):
    name: str

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state this rule keeps for ``param`` (zeros until the first step)."""

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        """Change ``param`` in place by ``grad`` (dense, or a sparse COO over its first dimension)."""


def _rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, row values) of a gradient: a sparse one's, duplicates summed, or every row."""
    if not grad.is_sparse:
        return torch.arange(grad.shape[0]), grad
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


@dataclass(frozen=True)
class Sgd:
    name: str = "sgd"

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        return {}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        if is_half(param):
            add_rows(param, *_rows(grad), alpha=-lr)
        else:
            param.add_(grad, alpha=-lr)      # a sparse gradient adds into its rows only


@dataclass(frozen=True)
class Adagrad:
    name: str = "adagrad"
    eps: float = EPS

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        return {"step": (), "sum": tuple(param.shape)}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        total = state["sum"]
        if "step" in state:
            state["step"] += 1
        if grad.is_sparse or is_half(param):
            rows, values = _rows(grad)
            total.index_add_(0, rows, values * values)
            add_rows(param, rows, values / total[rows].sqrt().add_(self.eps), alpha=-lr)
        else:
            total.addcmul_(grad, grad)
            param.addcdiv_(grad, total.sqrt().add_(self.eps), value=-lr)


@dataclass(frozen=True)
class RowWiseAdagrad:
    name: str = "rowwise_adagrad"
    eps: float = EPS

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        return {"sum": (param.shape[0],)}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        total = state["sum"]
        rows, values = _rows(grad)
        if values.shape[0] == 0:         # a step that touched no row of it (a hashed table's ids unadmitted)
            return
        flat = values.reshape(values.shape[0], -1)
        total.index_add_(0, rows, flat.pow(2).mean(dim=1))
        scale = total[rows].sqrt().add_(self.eps).reciprocal_()
        add_rows(param, rows, (flat * scale[:, None]).view_as(values), alpha=-lr)


RULES: dict[str, UpdateRule] = {r.name: r for r in (Sgd(), Adagrad(), RowWiseAdagrad())}


def rule(name: str) -> UpdateRule:
    """The built-in rule called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown update rule {name!r}: one of {', '.join(RULES)}") from None


def resolve(given: "UpdateRule | str") -> UpdateRule:
    return rule(given) if isinstance(given, str) else given


class RuleOptimizer:
    """Parameters stepped by their rules with their gradients (``.grad``), with ``torch.optim``'s
    face: ``step``, ``zero_grad``, ``state`` by parameter (made at its first step), and
    ``state_dict``/``load_state_dict`` between optimizers over the same parameters."""

    def __init__(self, params: list[tuple[torch.nn.Parameter, UpdateRule]], lr: float) -> None:
        self.params, self.lr = params, lr
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, grads: Optional[dict[torch.Tensor, torch.Tensor]] = None) -> None:
        """Step every parameter with a gradient: ``grads[p]`` when given (a half-precision
        parameter's is fp32, which its ``.grad`` could not hold), else ``p.grad``."""
        for p, r in self.params:
            grad = p.grad if grads is None else grads.get(p)
            if grad is None:
                continue
            if p not in self.state:
                dtype = torch.float32 if is_half(p) else p.dtype
                self.state[p] = {k: torch.zeros(shape, dtype=torch.float32 if k == "step" else dtype)
                                 for k, shape in r.state_shapes(p).items()}
            r.step(p, grad, self.state[p], self.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self.params:
            p.grad = None

    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: {k: v.clone() for k, v in self.state[p].items()} for i, (p, _) in enumerate(self.params)
                if p in self.state}

    def load_state_dict(self, state: dict[int, dict[str, torch.Tensor]]) -> None:
        self.state = {p: {k: v.clone() for k, v in state[i].items()} for i, (p, _) in enumerate(self.params)
                      if i in state}


def make_optimizer(kind: "UpdateRule | str", params: list[torch.nn.Parameter], lr: float) -> RuleOptimizer:
    """Every parameter stepped by one rule (``ps/spec/rules.py``), its state made at its first step (a
    restore would throw away state filled up front: 0.3 s per 512 MB)."""
    return RuleOptimizer([(p, resolve(kind)) for p in params], lr)


def grad_sq_norm(grads: list[torch.Tensor]) -> float:
    total = 0.0
    for g in grads:
        values = g.coalesce().values() if g.is_sparse else g
        total += float(values.pow(2).sum())
    return total


def clip_coef(clip: float, norm: float) -> float:
    """The factor a gradient of global norm ``norm`` is scaled by when clipped to ``clip`` (0: off):
    the servers' rule."""
    return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
