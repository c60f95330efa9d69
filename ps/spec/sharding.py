"""Where everything lives: pure values computed before any RPC.

Each table is placed as its ``Table.placement`` says (as TorchRec's ``ParameterSharding``):

* **row-wise** (``ShardPlan``), for big tables: row ``id`` (every parameter of the table alike) on
  shard ``id % num_shards`` at local row ``id // num_shards``;
* **table-wise** (``WholePlan``), for tables smaller than the server count: the whole table on one
  shard, the ``t``-th table's on shard ``t % num_shards``, so small tables spread over the servers.

* **hashed** (``HashedPlan``), for a table keyed by raw 64-bit ids: id ``id`` on shard
  ``id % num_shards``, at whichever row that shard's index gives it (``ps/server/hashed/``).

Unsaid, a table is row-wise when it has at least a row per shard. The ``g``-th dense group lives on
shard ``g % num_shards``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ps.spec.model import ModelSpec


@dataclass(frozen=True)
class ShardPlan:
    """One id space (a table's rows) over ``num_shards`` shards."""

    num_shards: int
    num_ids: int         # the ids: 0 .. num_ids - 1

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.num_ids < self.num_shards:
            raise ValueError(f"num_ids ({self.num_ids}) must be >= num_shards ({self.num_shards})")

    @property
    def id_max(self) -> int:
        """The largest id a request may name."""
        return self.num_ids - 1

    def rows(self, shard: int) -> int:
        """How many ids shard ``shard`` owns."""
        return (self.num_ids - shard + self.num_shards - 1) // self.num_shards

    def global_ids(self, shard: int) -> torch.Tensor:
        return torch.arange(shard, self.num_ids, self.num_shards)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % self.num_shards

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        return ids // self.num_shards

    def partition(self, unique_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per shard: (positions in ``unique_ids``, the global ids there), positions rising."""
        if self.num_shards == 1:
            return [(torch.arange(unique_ids.numel()), unique_ids)]
        owners = self.owner(unique_ids)
        out = []
        for shard in range(self.num_shards):
            pos = (owners == shard).nonzero(as_tuple=True)[0]
            out.append((pos, unique_ids[pos]))
        return out


@dataclass(frozen=True)
class HashedPlan(ShardPlan):
    """A hashed table (``ps/server/hashed/``): raw 64-bit id ``id`` on shard ``id % num_shards`` (any
    int64, negative too), in whichever of the shard's rows its index gives it; ``num_ids`` is the
    table's capacity in rows, shared out as ``ShardPlan`` shares ids."""

    @property
    def id_max(self) -> int:
        return torch.iinfo(torch.int64).max

    def global_ids(self, shard: int) -> torch.Tensor:
        raise TypeError("a hashed table's rows have no fixed ids: ask its index")

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("a hashed table's ids find their rows in its index")


@dataclass(frozen=True)
class WholePlan:
    """One id space kept whole on shard ``home`` of ``num_shards``: ``ShardPlan``'s interface."""

    num_shards: int
    num_ids: int
    home: int

    def __post_init__(self) -> None:
        if not 0 <= self.home < self.num_shards:
            raise ValueError(f"home {self.home} is not a shard of {self.num_shards}")

    @property
    def id_max(self) -> int:
        return self.num_ids - 1

    def rows(self, shard: int) -> int:
        return self.num_ids if shard == self.home else 0

    def global_ids(self, shard: int) -> torch.Tensor:
        return torch.arange(self.num_ids if shard == self.home else 0)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full_like(ids, self.home)

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def partition(self, unique_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        nothing = torch.empty(0, dtype=torch.long)
        return [(torch.arange(unique_ids.numel()), unique_ids) if k == self.home else (nothing, nothing)
                for k in range(self.num_shards)]


Plan = ShardPlan | HashedPlan | WholePlan


def plan_of(placement: str, num_shards: int, num_ids: int, index: int) -> Plan:
    """The plan of the ``index``-th table (``placement``: row_wise, table_wise, hashed, or "" for
    the default: row-wise when every shard gets a row)."""
    placement = placement or ("row_wise" if num_ids >= num_shards else "table_wise")
    if placement == "hashed":       # raw ids spread over every shard: each needs a row at least
        return HashedPlan(num_shards, max(num_ids, num_shards))
    if placement == "row_wise":
        return ShardPlan(num_shards, num_ids)
    if placement == "table_wise":
        return WholePlan(num_shards, num_ids, index % num_shards)
    raise ValueError(f"unknown placement {placement!r}: row_wise or table_wise")


def placement_of(plan: Plan) -> tuple[str, int]:
    """(kind, home) as a server tells it to its clients (home: 0 unless table-wise)."""
    if isinstance(plan, WholePlan):
        return "table_wise", plan.home
    return ("hashed" if isinstance(plan, HashedPlan) else "row_wise"), 0


def from_placement(placed: tuple[str, int], num_shards: int, num_ids: int) -> Plan:
    """The plan a server told of with ``placement_of``."""
    kind, home = placed
    return WholePlan(num_shards, num_ids, home) if kind == "table_wise" else plan_of(kind, num_shards, num_ids, 0)


@dataclass(frozen=True)
class Layout:
    """A model's tables and dense groups over ``num_shards`` shards."""

    num_shards: int
    plans: dict[str, Plan]                         # per table
    table_params: dict[str, tuple[str, ...]]       # per table, its parameters
    dense_groups: tuple[tuple[str, ...], ...]      # the g-th group's parameters
    # per table parameter, its optimizer state indexed by rows, as its rule says (none: a state
    # saved before rules said it, told by its shape)
    row_state: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: ModelSpec, num_shards: int) -> "Layout":
        return cls(num_shards, {t: plan_of("hashed" if table.hashed else table.placement, num_shards,
                                           table.rows, i) for i, (t, table) in enumerate(spec.tables.items())},
                   {t: tuple(table.params) for t, table in spec.tables.items()},
                   tuple(tuple(group.params) for group in spec.dense),
                   {p: spec.rule_of(t).row_state for t, table in spec.tables.items() for p in table.params})

    def group_owner(self, group: int) -> int:
        return group % self.num_shards

    def groups_of(self, shard: int) -> list[int]:
        return [g for g in range(len(self.dense_groups)) if self.group_owner(g) == shard]

    def dense_of(self, shard: int) -> list[str]:
        return [name for g in self.groups_of(shard) for name in self.dense_groups[g]]

    def table_of(self, param: str) -> str:
        for table, params in self.table_params.items():
            if param in params:
                return table
        raise KeyError(param)

    def hashed_tables(self) -> list[str]:
        return [t for t, plan in self.plans.items() if isinstance(plan, HashedPlan)]

    def row_params(self) -> list[str]:
        return [name for params in self.table_params.values() for name in params]
