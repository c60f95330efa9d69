"""Values that cross RPC between trainers and servers (the .proto of the service)."""
from __future__ import annotations

from dataclasses import dataclass, field

FREEZE_SECONDS = 120.0         # a checkpoint's freeze of the step clock outlives its pause by far; a lost thaw ends with it


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
    consistency: str = "async"  # how the job applies updates (``ps/spec/consistency.py``)
    placement: dict[str, tuple[str, int]] = field(default_factory=dict)   # table -> (kind, home): ps/spec/sharding.py
    max_ids: int = 65_536       # the most ids one request may name (--max-ids-per-request)
    row_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)   # a row's shape, per table parameter
    epoch: int = 1              # the layout it serves by (``ps/spec/sharding.py``'s ``Slots``)
    ids: dict[str, int] = field(default_factory=dict)    # each table's ids in all (a hashed table's capacity)
    counted: tuple[str, ...] = ()   # the tables whose updates it counts (``ps/spec/counting.py``): trainers count theirs


@dataclass(frozen=True)
class Mark:
    """What a trainer's update says of itself, so that a server applies each batch once: the
    trainer's ``steps`` once it is applied (a replacement numbers its batches as the incarnation
    before it did, from the position it resumes), the ``records`` of its batch, and the
    ``position`` its data stands at after the batch (its ``Task.position``)."""

    steps: int
    records: int
    position: dict


@dataclass(frozen=True)
class Granted:
    """``begin``'s answer: the step the trainer may begin now, and in lockstep its group."""

    step: int
    group: tuple[str, ...] = ()      # lockstep: the trainers taking this step, in rank order
    group_key: str = ""              # lockstep: the same for every step of one group, new with each group


@dataclass(frozen=True)
class Applied:
    """``arrive``'s answer: the step is applied (sync: on every server; ssp: the trainer's own)."""

    step: int                        # the trainer's clock after this step
    participants: tuple[str, ...]    # sync: whose gradients the update averaged
    grad_norm: float                 # sync: of the averaged gradient, before clipping (nan otherwise)
