"""The model's parameters and the math the servers run on them; plain modules, testable locally.

Initialisation is defined for the whole model and each shard takes its slice, so a sharded
cluster starts from exactly the parameters of the one-process model (``trainer/model.py``).
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from services.config import ModelConfig


def _generator(cfg: ModelConfig, tag: str) -> torch.Generator:
    # One stream per tensor, so a shard can build its part without drawing everyone else's.
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(tag.encode()))


def init_embedding(cfg: ModelConfig) -> torch.Tensor:
    """[ntoken, emsize]"""
    return torch.empty(cfg.ntoken, cfg.emsize).uniform_(-cfg.init_range, cfg.init_range, generator=_generator(cfg, "emb"))


def init_decoder(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [ntoken, nhid], bias [ntoken]"""
    w = torch.empty(cfg.ntoken, cfg.nhid).uniform_(-cfg.init_range, cfg.init_range, generator=_generator(cfg, "dec"))
    return w, torch.zeros(cfg.ntoken)


def lstm_param_names(layer: int) -> list[str]:
    return [f"weight_ih_l{layer}", f"weight_hh_l{layer}", f"bias_ih_l{layer}", f"bias_hh_l{layer}"]


def init_lstm_layer(cfg: ModelConfig, layer: int) -> dict[str, torch.Tensor]:
    """nn.LSTM's own rule (uniform ±1/sqrt(nhid)), drawn from a per-layer stream."""
    g = _generator(cfg, f"lstm{layer}")
    k = 1.0 / math.sqrt(cfg.nhid)
    inp = cfg.emsize if layer == 0 else cfg.nhid
    shapes = [(4 * cfg.nhid, inp), (4 * cfg.nhid, cfg.nhid), (4 * cfg.nhid,), (4 * cfg.nhid,)]
    return {n: torch.empty(s).uniform_(-k, k, generator=g) for n, s in zip(lstm_param_names(layer), shapes)}


class EmbeddingShard(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # [rows, emsize]

    def forward(self, local_ids: torch.Tensor) -> torch.Tensor:
        # sparse=True: a step's gradient (and update) touches only the rows it used.
        return F.embedding(local_ids, self.weight, sparse=True)


class SoftmaxPartials(torch.autograd.Function):
    """One shard's share of a softmax cross-entropy over a vocabulary split across shards.

    Returns per token the log-sum-exp of this shard's logits and the target's logit where the shard
    owns the target (0 elsewhere); the trainer combines them into the loss, so no [tokens, vocab]
    tensor crosses RPC. ``weight_snapshot``/``bias_snapshot`` are private copies: other trainers'
    optimizer steps change the live parameters in place between this forward and its backward.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, weight_snapshot, bias_snapshot, local_target, owned):
        logits = torch.addmm(bias_snapshot, h, weight_snapshot.t())          # [N, rows]
        lse = torch.logsumexp(logits, dim=1)                                 # [N]
        target_logit = logits.gather(1, local_target.unsqueeze(1)).squeeze(1) * owned
        probs = logits.sub_(lse.unsqueeze(1)).exp_()  # reuse the logits buffer: halves peak memory
        ctx.save_for_backward(h, weight_snapshot, probs, local_target, owned)
        return lse, target_logit

    @staticmethod
    def backward(ctx, grad_lse, grad_target):
        h, weight, probs, local_target, owned = ctx.saved_tensors
        grad_logits = probs.mul_(grad_lse.unsqueeze(1))  # probs is not needed after this
        grad_logits.scatter_add_(1, local_target.unsqueeze(1), (grad_target * owned).unsqueeze(1))
        grad_h = grad_logits @ weight
        grad_weight = grad_logits.t() @ h
        grad_bias = grad_logits.sum(0)
        return grad_h, grad_weight, grad_bias, None, None, None, None


class DecoderShard(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # [rows, nhid]
        self.bias = nn.Parameter(bias)      # [rows]

    def partials(self, h: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor,
                 weight_snapshot: torch.Tensor, bias_snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return SoftmaxPartials.apply(h, self.weight, self.bias, weight_snapshot, bias_snapshot, local_target, owned)


def combine_partials(lse_parts: list[torch.Tensor], target_parts: list[torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy from the shards' partial results."""
    lse = torch.logsumexp(torch.stack(lse_parts), dim=0)
    target_logit = torch.stack(target_parts).sum(0)
    return (lse - target_logit).mean()
