"""The trainer-side client of the parameter servers: the only place trainers touch RPC.

It hides the fan-out: a lookup deduplicates ids, asks every owning shard in parallel and reassembles
the batch; a decode asks every shard for its partials in parallel. Called inside a distributed
autograd context, everything it returns carries the way back for gradients.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed.optim import DistributedOptimizer

from ps.messages import ShardInfo
from ps.modules import combine_partials
from ps.service import ParameterServer, ServerOptimizer
from ps.sharding import ShardPlan
from ps.config import ModelConfig
from services.errors import PeerUnavailable
from services.remote import call_async, wait

log = logging.getLogger(__name__)


class PsClient:
    def __init__(self, me: str, ps_names: list[str], timeout: float = 60.0) -> None:
        self.me, self.ps_names, self.timeout = me, ps_names, timeout
        infos: list[ShardInfo] = [wait(f) for f in [self._async(n, ParameterServer.info) for n in ps_names]]
        for k, info in enumerate(infos):
            if info.shard != k or info.num_shards != len(ps_names):
                raise PeerUnavailable(f"{ps_names[k]} serves shard {info.shard} of {info.num_shards}, "
                                      f"expected shard {k} of {len(ps_names)}: check --num-ps everywhere")
            if info.model != infos[0].model:
                raise PeerUnavailable(f"{ps_names[k]} hosts a different model than {ps_names[0]}")
        self.model = ModelConfig.model_validate(infos[0].model)
        self.plan = ShardPlan(len(ps_names), self.model.ntoken)
        self.layer_owner = {layer: self.plan.layer_owner(layer) for layer in range(self.model.nlayers)}
        self._dense_shards = sorted(set(self.layer_owner.values()))
        rrefs = [wait(f) for f in [self._async(n, ParameterServer.param_rrefs) for n in ps_names]]
        self.param_rrefs = [r for shard in rrefs for r in shard]

    def _async(self, ps: str, method: Callable[..., Any], *args: Any) -> torch.futures.Future:
        return call_async(ps, method, *args, timeout=self.timeout)

    def call(self, ps: str, method: Callable[..., Any], *args: Any) -> Any:
        """One method of one server, synchronously."""
        return wait(self._async(ps, method, *args))

    def optimizer(self) -> DistributedOptimizer:
        return DistributedOptimizer(ServerOptimizer, self.param_rrefs)

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Embeddings of ``ids`` [...] -> [..., emsize], and the LSTM weights, in one parallel round."""
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        parts = [(pos, self._async(self.ps_names[k], ParameterServer.lookup, shard_ids))
                 for k, (pos, shard_ids) in enumerate(self.plan.partition(unique)) if pos.numel()]
        dense = [self._async(self.ps_names[k], ParameterServer.dense_params) for k in self._dense_shards]
        rows = torch.cat([wait(f) for _, f in parts])               # [unique, emsize], shard order
        order = torch.cat([pos for pos, _ in parts])
        by_unique = rows[torch.argsort(order)]                      # back to torch.unique's order
        weights: dict[str, torch.Tensor] = {}
        for f in dense:
            weights.update(wait(f))
        return by_unique[inverse].view(*ids.shape, self.model.emsize), weights

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``h`` [N, nhid] against ``targets`` [N], computed by the shards."""
        futs = [self._async(n, ParameterServer.decode, h, targets) for n in self.ps_names]
        results = [wait(f) for f in futs]
        return combine_partials([r[0] for r in results], [r[1] for r in results])

    def clip_(self, context_id: int, max_norm: float) -> float:
        """Global gradient-norm clipping over every shard's gradients in ``context_id``."""
        sq = sum(wait(f) for f in [self._async(n, ParameterServer.grad_sq_norm, context_id) for n in self.ps_names])
        norm = float(sq) ** 0.5
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for f in [self._async(n, ParameterServer.scale_grads, context_id, float(coef)) for n in self.ps_names]:
                wait(f)
        return norm


def new_context() -> Any:
    return dist_autograd.context()


def backward(context_id: int, loss: torch.Tensor) -> None:
    dist_autograd.backward(context_id, [loss])
