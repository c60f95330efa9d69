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
``name``, ``rows_only``, ``row_state`` (which of its state values are indexed by the parameter's rows, so a
checkpoint, a resharding and a hashed table's reused rows move them with the rows),
``state_shapes`` and ``step``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Literal, Optional, Protocol

if TYPE_CHECKING:
    import torch

# torch (and ps/spec/precision.py, over it) is imported where a rule steps, not with this module:
# settings choose among the rules' names (``choices``), and a command's --help loads no torch.

EPS = 1e-10      # torch.optim.Adagrad's


class UpdateRule(Protocol):
    name: str
    row_state: tuple[str, ...]      # the state values indexed by the parameter's rows: cut, gathered and moved with them
    rows_only: bool                 # steps a table's rows only, not a dense parameter

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state this rule keeps for ``param`` (zeros until the first step)."""

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        """Change ``param`` in place by ``grad`` (dense, or a sparse COO over its first dimension)."""


def _rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, row values) of a gradient: a sparse one's, duplicates summed, or every row."""
    import torch
    if not grad.is_sparse:
        return torch.arange(grad.shape[0]), grad
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


@dataclass(frozen=True)
class Sgd:
    name: str = "sgd"
    row_state: tuple[str, ...] = ()
    rows_only: bool = False

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        return {}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        from ps.spec.precision import add_rows, is_half
        if is_half(param):
            add_rows(param, *_rows(grad), alpha=-lr)
        else:
            param.add_(grad, alpha=-lr)      # a sparse gradient adds into its rows only


@dataclass(frozen=True)
class Adagrad:
    name: str = "adagrad"
    row_state: tuple[str, ...] = ("sum",)
    rows_only: bool = False
    eps: float = EPS

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        return {"step": (), "sum": tuple(param.shape)}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        from ps.spec.precision import add_rows, is_half
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
    row_state: tuple[str, ...] = ("sum",)
    rows_only: bool = True
    eps: float = EPS

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        return {"sum": (param.shape[0],)}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        from ps.spec.precision import add_rows
        total = state["sum"]
        rows, values = _rows(grad)
        if values.shape[0] == 0:         # a step that touched no row of it (a hashed table's ids unadmitted)
            return
        flat = values.reshape(values.shape[0], -1)
        total.index_add_(0, rows, flat.pow(2).mean(dim=1))
        scale = total[rows].sqrt().add_(self.eps).reciprocal_()
        add_rows(param, rows, (flat * scale[:, None]).view_as(values), alpha=-lr)


# The one registry of rules by name: a table's `rule` in a schema, `--table-rule` and `--optimizer`
# choose among these (``choices``).
RULES: dict[str, UpdateRule] = {r.name: r for r in (Sgd(), Adagrad(), RowWiseAdagrad())}


def choices(tables: bool = True) -> Any:
    """The registered rules' names as a ``Literal`` type, for a setting that chooses one (its
    flag's choices, its schema key's values): any rule for a table, or (``tables=False``) those
    that step a dense parameter too."""
    return Literal[tuple(name for name, r in RULES.items() if tables or not r.rows_only)]


def rule(name: str) -> UpdateRule:
    """The built-in rule called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown update rule {name!r}: one of {', '.join(RULES)}") from None


def resolve(given: "UpdateRule | str") -> UpdateRule:
    return rule(given) if isinstance(given, str) else given


def by_row(keys: Optional[Iterable[str]], state: dict[str, torch.Tensor], rows: int) -> list[str]:
    """Which values of a parameter's optimizer ``state`` are indexed by its rows: those its rule
    names (``keys``: the rule's ``row_state``), or, for a state saved before rules named them
    (``keys`` None), those whose first dimension is the parameter's ``rows``."""
    if keys is not None:
        return [k for k in keys if k in state]
    return [k for k, v in state.items() if v.dim() > 0 and v.shape[0] == rows]


class RuleOptimizer:
    """Parameters stepped by their rules with their gradients (``.grad``), with ``torch.optim``'s
    face: ``step``, ``zero_grad``, ``state`` by parameter (made at its first step), and
    ``state_dict``/``load_state_dict`` between optimizers over the same parameters."""

    def __init__(self, params: list[tuple[torch.nn.Parameter, UpdateRule]], lr: float) -> None:
        self.params, self.lr = params, lr
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._rules = {id(p): r for p, r in params}

    def rule_of(self, param: torch.Tensor) -> UpdateRule:
        return self._rules[id(param)]

    def step(self, grads: Optional[dict[torch.Tensor, torch.Tensor]] = None) -> None:
        """Step every parameter with a gradient: ``grads[p]`` when given (a half-precision
        parameter's is fp32, which its ``.grad`` could not hold), else ``p.grad``."""
        import torch
        with torch.no_grad():
            self._step(grads)

    def _step(self, grads: Optional[dict[torch.Tensor, torch.Tensor]]) -> None:
        import torch

        from ps.spec.precision import is_half
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
