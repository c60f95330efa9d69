"""A checkpoint's whole model in one place, to take it out of the cluster: every server's file
(its delta chain applied, every checksum verified) gathered as one server would hold it: a plain
table's rows in id order, a hashed table's live ids and their rows, every dense tensor."""
from __future__ import annotations

from ps.server.delta import apply_delta
from ps.server.participant import shard_files
from ps.server.state import Gathered, gather_shard
from ps.spec.model import ModelSpec
from ps.spec.rules import by_row
from ps.spec.sharding import Layout, ShardPlan, resumed_slots
from services.checkpoint.parts import restore_newest
from services.checkpoint.store import CheckpointInfo, CheckpointStore


def whole_model(store: CheckpointStore, info: CheckpointInfo, spec: ModelSpec) -> Gathered:
    """``info``'s shards as one (``CheckpointError`` if a file is missing, corrupt, or of another
    model than ``spec``)."""
    one = resumed_slots(spec, ["ps0"], info.meta.get("layout"))
    layout = Layout.of(spec, one)
    _, gathered = restore_newest(store, True, info.id, lambda i: shard_files(i, spec, one, "ps0"),
                                 lambda states: gather_shard(states, layout, 0), merge=apply_delta)
    return _in_id_order(gathered, layout)


def _in_id_order(gathered: Gathered, layout: Layout) -> Gathered:
    """One server's rows of a plain table are its ids in order, then the rows of no id that fill
    its last column (``ShardPlan``): those left out."""
    params, optim = dict(gathered.params), {n: dict(s) for n, s in gathered.optim.items()}
    for table, plan in layout.plans.items():
        if type(plan) is not ShardPlan:
            continue
        for name in layout.table_params[table]:
            rows = params[name].shape[0]
            params[name] = params[name][:plan.num_ids]
            for key in by_row(layout.row_state.get(name), optim.get(name, {}), rows):
                optim[name][key] = optim[name][key][:plan.num_ids]
    return gathered._replace(params=params, optim=optim)
