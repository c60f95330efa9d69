"""Where every row and dense parameter lives: a pure value computed before any RPC.

Vocabulary rows (embedding and decoder alike) go to shard ``id % num_shards`` at local row
``id // num_shards``; LSTM layer ``l`` lives on shard ``l % num_shards``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardPlan:
    num_shards: int
    ntoken: int

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.ntoken < self.num_shards:
            raise ValueError(f"ntoken ({self.ntoken}) must be >= num_shards ({self.num_shards})")

    def rows(self, shard: int) -> int:
        """How many vocabulary ids shard ``shard`` owns."""
        return (self.ntoken - shard + self.num_shards - 1) // self.num_shards

    def global_ids(self, shard: int) -> torch.Tensor:
        return torch.arange(shard, self.ntoken, self.num_shards)

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

    def layer_owner(self, layer: int) -> int:
        return layer % self.num_shards

    def layers_of(self, shard: int, nlayers: int) -> list[int]:
        return [layer for layer in range(nlayers) if self.layer_owner(layer) == shard]
