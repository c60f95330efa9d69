"""A checkpoint's whole model in one place, to take it out of the cluster: every server's file
(its delta chain applied, every checksum verified) gathered as one server would hold it: a plain
table's rows in id order, a hashed table's live ids and their rows, every dense tensor."""
from __future__ import annotations

from ps.server.delta import apply_delta
from ps.server.participant import shard_files
from ps.server.state import Gathered, gather_shard
from ps.spec.model import ModelSpec
from ps.spec.sharding import Layout, resumed_slots
from services.checkpoint.parts import restore_newest
from services.checkpoint.store import CheckpointInfo, CheckpointStore


def whole_model(store: CheckpointStore, info: CheckpointInfo, spec: ModelSpec) -> Gathered:
    """``info``'s shards as one (``CheckpointError`` if a file is missing, corrupt, or of another
    model than ``spec``)."""
    one = resumed_slots(spec, ["ps0"], info.meta.get("layout"))
    _, gathered = restore_newest(store, True, info.id, lambda i: shard_files(i, spec, one, "ps0"),
                                 lambda states: gather_shard(states, Layout.of(spec, one), 0), merge=apply_delta)
    return gathered
