"""A server shard's state as a plain dict for checkpoints, and resharding on restore; pure.

Rows of the vocabulary-indexed parameters (embedding, decoder) are stored with their global ids, so
a checkpoint taken with K servers restores into any number of servers: each new shard gathers the
ids it owns from every old shard. Optimizer state tensors shaped like their parameter are resharded
the same way.
"""
from __future__ import annotations

from typing import Any

import torch

from ps.sharding import ShardPlan

FORMAT = 1
ROW_PARAMS = ("embedding.weight", "decoder.weight", "decoder.bias")


def export_shard(shard: int, plan: ShardPlan, model: dict, steps: int, params: dict[str, torch.Tensor],
                 optim_state: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """``params``/``optim_state`` must already be private copies (taken under the server's lock)."""
    return {"format": FORMAT, "shard": shard, "num_shards": plan.num_shards, "model": dict(model), "steps": steps,
            "global_ids": plan.global_ids(shard), "params": params, "optim": optim_state}


def gather_shard(states: list[dict[str, Any]], plan: ShardPlan, shard: int, layers: tuple[int, ...],
                 dense_names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], int]:
    """(params, optimizer state, steps applied) of ``shard`` under ``plan``, from every old shard."""
    if not states:
        raise ValueError("no shard states to restore from")
    if len(states) == 1 and states[0]["num_shards"] == plan.num_shards and states[0]["shard"] == shard:
        own = states[0]  # same cluster shape: this shard's own file, as saved (the caller's to keep)
        if not torch.equal(own["global_ids"], plan.global_ids(shard)):
            raise ValueError(f"shard {shard}'s saved rows do not match a {plan.ntoken}-row vocabulary")
        return dict(own["params"]), {n: dict(st) for n, st in own["optim"].items()}, int(own["steps"])
    if sorted(s["shard"] for s in states) != list(range(states[0]["num_shards"])):
        raise ValueError(f"need every old shard 0..{states[0]['num_shards'] - 1}, got {sorted(s['shard'] for s in states)}")
    ids = torch.cat([s["global_ids"] for s in states])
    if ids.numel() != plan.ntoken or not torch.equal(torch.sort(ids).values, torch.arange(plan.ntoken)):
        raise ValueError(f"the old shards hold {ids.numel()} vocabulary rows, this model has {plan.ntoken}")
    # Position of each global id in the concatenation, then the rows this shard owns, in its order.
    where = torch.empty(plan.ntoken, dtype=torch.long)
    where[ids] = torch.arange(ids.numel())
    pick = where[plan.global_ids(shard)]

    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name in ROW_PARAMS:
        params[name] = torch.cat([s["params"][name] for s in states])[pick].clone()
        keys = set().union(*(s["optim"].get(name, {}).keys() for s in states))
        if keys:
            optim[name] = {}
            for key in keys:
                parts = [s["optim"][name][key] for s in states]
                if parts[0].dim() > 0 and parts[0].size(0) == _rows(states[0], name):
                    optim[name][key] = torch.cat(parts)[pick].clone()
                else:  # scalars such as Adagrad's step count: the largest is the truest
                    optim[name][key] = torch.stack([p.reshape(()) for p in parts]).max().clone()
    for name in dense_names:
        holder = [s for s in states if name in s["params"]]
        if len(holder) != 1:
            raise ValueError(f"dense parameter {name} found in {len(holder)} old shards, expected 1")
        params[name] = holder[0]["params"][name].clone()
        if name in holder[0]["optim"]:
            optim[name] = {k: v.clone() for k, v in holder[0]["optim"][name].items()}
    return params, optim, max(int(s["steps"]) for s in states)


def _rows(state: dict[str, Any], name: str) -> int:
    return state["params"][name].size(0)
