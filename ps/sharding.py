"""Where everything lives: pure values computed before any RPC.

A table's rows (every parameter of the table alike) go to shard ``id % num_shards`` at local row
``id // num_shards``; the ``g``-th dense group lives on shard ``g % num_shards``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ps.spec import ModelSpec


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
        """Per shard: (positions in ``unique_ids``, the global ids there)."""
        owners = self.owner(unique_ids)
        out = []
        for shard in range(self.num_shards):
            pos = (owners == shard).nonzero(as_tuple=True)[0]
            out.append((pos, unique_ids[pos]))
        return out


@dataclass(frozen=True)
class Layout:
    """A model's tables and dense groups over ``num_shards`` shards."""

    num_shards: int
    plans: dict[str, ShardPlan]                    # per table
    table_params: dict[str, tuple[str, ...]]       # per table, its parameters
    dense_groups: tuple[tuple[str, ...], ...]      # the g-th group's parameters

    @classmethod
    def of(cls, spec: ModelSpec, num_shards: int) -> "Layout":
        return cls(num_shards, {t: ShardPlan(num_shards, table.rows) for t, table in spec.tables.items()},
                   {t: tuple(table.params) for t, table in spec.tables.items()},
                   tuple(tuple(group.params) for group in spec.dense))

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

    def row_params(self) -> list[str]:
        return [name for params in self.table_params.values() for name in params]
