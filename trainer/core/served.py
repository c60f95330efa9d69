"""A trainer's view of a model the parameter servers host: its tables' rows and dense weights
fetched in one round each step, and with ``--dense allreduce`` the dense weights held here
instead, as a replica the trainers keep equal (``trainer/core/replica.py``). A workload's model
(the language model's, the CTR model's) is this plus its own computation."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed import Store
from torch.func import functional_call

from ps.spec.surface import PsSurface
from ps.client.client import PsClient
from services.errors import ConfigError
from trainer.core.hot_rows import ReplicatedRows, ServerRows, table_rules
from trainer.core.replica import DenseReplica


class ServedModel(nn.Module):
    """``dense``: a skeleton of the servers' dense weights, named as they name them (its own
    values are never used unless it becomes the replica); ``forward_module``: what computes with
    them (``dense`` itself unless it wraps them)."""

    def __init__(self, client: PsClient, dense: nn.Module, forward_module: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.client = client
        self.dense = dense
        self.forward_module = forward_module if forward_module is not None else dense
        for p in self.dense.parameters():
            p.requires_grad_(False)
        self.replica: Optional[DenseReplica] = None

    def replicate(self, store_for: Callable[[str], Store], timeout: float,
                  hot: Optional[ReplicatedRows] = None) -> None:
        """``--dense allreduce``: hold the dense weights here, starting from the servers' weights and
        their optimizer state, kept equal to the other trainers' replicas by a process group of the
        trainers of each step, whose members meet in ``store_for(key)`` and wait ``timeout`` for
        each other. Steps begin in lockstep. ``hot``: the tables' hot rows, replicated with them
        (``--cache-staleness 0``)."""
        _, weights = self.client.fetch({})
        model = self.client.model
        if "optimizer" not in model or "lr" not in model:
            raise ConfigError("--dense allreduce steps the dense weights by the servers' rule, but their model "
                              "names no optimizer and lr (its ModelSpec.meta)")
        rule, lr = model["optimizer"], float(model["lr"])
        if hot is not None:
            routes = self.client.routes
            hot.bind(ServerRows(self.client), table_rules(model), lr,
                     {p: routes.plans[t].num_ids for p, t in routes.table_of.items()})
        self.replica = DenseReplica(self.client.me, self.forward_module, rule, lr, weights, store_for, timeout,
                                    named=self.dense, hot=hot)
        for state in self.client.each_dense_shard(PsSurface.dense_state):
            self.replica.load_optimizer_state(state)
        self.client.clock.lockstep = True

    def follow_group(self) -> None:
        """At a step's beginning: with a replica, be in the group the step was granted with."""
        if self.replica is None:
            return
        try:
            self.replica.follow(self.client.clock.granted)
        except Exception as exc:
            raise self.client.clock.lose_step(exc, self.replica) from exc

    @property
    def allreduce_bytes(self) -> int:
        return self.replica.allreduce_bytes if self.replica is not None else 0

    def sum_over_trainers(self, values: list[float]) -> Optional[list[float]]:
        """With a replica: ``values`` summed over the trainers of its group, else None."""
        return self.replica.sum_over_group(values) if self.replica is not None else None

    def write_replica(self) -> None:
        """The replica's weights and optimizer state into the servers' dense tensors, and its hot
        rows into their tables (for a checkpoint), unless it has taken no step: then it holds the
        servers' own."""
        if self.replica.step >= 0:
            self.client.each_dense_shard(PsSurface.set_dense, self.replica.weights(), self.replica.step,
                                         self.replica.optimizer_state())
            if self.replica.hot is not None:
                self.replica.hot.give_back(self.replica.step)

    def fetch_rows(self, lookups: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The servers' current rows of ``lookups`` and dense weights (unless this trainer holds a
        replica of them), in one parallel round."""
        return self.client.fetch(lookups, dense=self.replica is None)

    def run_dense(self, weights: dict[str, torch.Tensor], *inputs: Any) -> Any:
        """``forward_module(*inputs)`` with the dense weights: the replica's, or ``weights`` fetched
        from the servers (their way back for gradients leads there)."""
        if self.replica is not None:
            return self.replica.forward(*inputs, training=self.training)
        self.forward_module.train(self.training)
        return functional_call(self.forward_module, _renamed(self.dense, self.forward_module, weights), inputs)


def _renamed(named: nn.Module, forward: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` by ``named``'s parameter names, as ``forward``'s names for the same tensors."""
    if named is forward:
        return weights
    by_id = {id(p): n for n, p in named.named_parameters()}
    return {n: weights[by_id[id(p)]] for n, p in forward.named_parameters() if id(p) in by_id}
