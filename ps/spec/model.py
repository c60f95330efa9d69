"""What a workload hands the parameter servers: the model they host, described, not built.

The servers know nothing of any workload's model. A ``ModelSpec`` names

* **tables**: parameters indexed by the same ids (their first dimension), row ``i`` of each on
  shard ``i % n`` (an embedding and the decoder of the same vocabulary, say); a hashed table is
  keyed by raw 64-bit ids, which get rows as they come, within its capacity;
* **dense groups**: tensors kept whole and together, the ``g``-th group on shard ``g % n`` (a layer);
* **ops**: named operations a server runs on its own rows for a trainer, so that what crosses RPC is
  a partial result instead of a whole table (the language model's sharded softmax);
* the update rules (``ps/spec/rules.py``): the model's ``optimizer`` for the dense groups and for every
  table without a ``rule`` of its own; and ``meta``: what the workload says its model is,
  which trainers read back and checkpoints record (``compatible``: the keys a checkpoint must match).

Each shard builds its own rows' initial values (a table's ``init`` is asked for given rows), so a
cluster of any size starts from exactly the one-process model's parameters, and no process builds
a whole table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from ps.spec.precision import dtype_of
from ps.spec.rules import UpdateRule, resolve


@dataclass(frozen=True)
class Lifecycle:
    """How a hashed table's rows come and go (a table's, declared in its ``Table``)."""

    admit_after: int = 1             # requests an id must appear in before it gets a row
    evict_after_steps: int = 0       # rows unseen this many steps go first (0: age alone evicts nothing)
    low_water: float = 0.9           # an eviction at capacity goes down to this share of it

    def __post_init__(self) -> None:
        if self.admit_after < 1 or self.evict_after_steps < 0 or not 0 < self.low_water <= 1:
            raise ValueError(f"a hashed table needs admit_after >= 1, evict_after_steps >= 0 and "
                             f"0 < low_water <= 1, got {self}")


@dataclass(frozen=True)
class Table:
    rows: int
    params: dict[str, tuple[int, ...]]                # name -> the shape of one row
    # The initial rows at global ids [n] of every param, [n, *shape]: a server asks only for its own,
    # a slice at a time, so no process builds a whole table.
    init: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    rule: "UpdateRule | str | None" = None            # its update rule (default: the model's optimizer)
    placement: str = ""                               # row_wise or table_wise (ps/spec/sharding.py); "": by size
    # Keyed by raw 64-bit ids instead of 0 .. rows - 1: ``rows`` is then its capacity, and rows
    # come and go as this says (``ps/server/hashed/``); ``init`` is asked for raw ids.
    hashed: Optional[Lifecycle] = None
    # How its rows are stored, and how they and their gradients cross the wire: fp32, fp16 or bf16
    # (``ps/spec/precision.py``). Half-precision rows are updated with stochastic rounding.
    dtype: str = "fp32"
    wire_dtype: str = "fp32"

    def __post_init__(self) -> None:
        dtype_of(self.dtype), dtype_of(self.wire_dtype)     # a ValueError naming the choices


@dataclass(frozen=True)
class DenseGroup:
    params: dict[str, tuple[int, ...]]                # name -> shape
    init: Callable[[], dict[str, torch.Tensor]]


class ServerOp(Protocol):
    """A named server-side operation: ``op(server, *args)`` on one shard (a ``ParameterServer``),
    inside the caller's distributed autograd context when there is one."""

    def __call__(self, server: Any, *args: Any) -> Any: ...


@dataclass(frozen=True)
class ModelSpec:
    tables: dict[str, Table]
    dense: tuple[DenseGroup, ...] = ()
    ops: dict[str, ServerOp] = field(default_factory=dict)
    optimizer: "UpdateRule | str" = "sgd"        # the rule of the dense groups, and of tables without their own
    lr: float = 0.1
    meta: dict[str, Any] = field(default_factory=dict)
    compatible: tuple[str, ...] = ()

    def rule_of(self, table: Optional[str]) -> UpdateRule:
        """The update rule of ``table``'s parameters, or (None) of the dense ones."""
        chosen = self.tables[table].rule if table is not None else None
        return resolve(chosen if chosen is not None else self.optimizer)

    def __post_init__(self) -> None:
        names = [n for t in self.tables.values() for n in t.params] + [n for g in self.dense for n in g.params]
        if len(names) != len(set(names)):
            raise ValueError(f"a parameter name is used twice in {names}")
        missing = [k for k in self.compatible if k not in self.meta]
        if missing:
            raise ValueError(f"compatible keys {missing} are not in the model's meta")
