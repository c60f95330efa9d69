"""Values that cross RPC between trainers and servers (the .proto of the service)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardInfo:
    name: str
    shard: int
    num_shards: int
    model: dict          # ModelConfig as a dict: trainers take the model's shape from the servers
    rows: int            # vocabulary rows this shard owns
    layers: tuple[int, ...]  # LSTM layers this shard owns
    steps: int = 0           # updates applied so far (continues across restores)
