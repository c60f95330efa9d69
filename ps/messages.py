"""Values that cross RPC between trainers and servers (the .proto of the service)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ShardInfo:
    name: str
    shard: int
    num_shards: int
    model: dict                 # the model's ``ModelSpec.meta``: trainers take its shape from the servers
    tables: dict[str, int]      # rows of each table this shard owns
    table_params: dict[str, tuple[str, ...]]   # each table's parameters
    dense: tuple[str, ...]      # the dense tensors it holds
    steps: int = 0              # updates applied so far (continues across restores)
    consistency: str = "async"  # how the job applies updates (``ps/consistency.py``)
    placement: dict[str, tuple[str, int]] = field(default_factory=dict)   # table -> (kind, home): ps/sharding.py
    max_ids: int = 65_536       # the most ids one request may name (--max-ids-per-request)
