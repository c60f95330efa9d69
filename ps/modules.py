"""The model's parameters and the math the servers run on them; plain modules, testable locally.

Initialisation is defined for the whole model and each shard takes its slice, so a sharded
cluster starts from exactly the parameters of the one-process model (``trainer/model.py``).
"""
from __future__ import annotations

import math
import threading
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ps.config import ModelConfig


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


class BufferPool:
    """Reuses the large [tokens, rows] buffers of SoftmaxPartials between calls.

    glibc serves allocations over 32 MB with mmap/munmap, so a fresh 46 MB buffer per call costs
    thousands of page faults and cross-core TLB shootdowns; reuse costs nothing. A buffer whose
    backward never comes (its trainer died) is simply garbage-collected.
    """

    def __init__(self, keep: int = 4) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._keep = keep

    def take(self, rows: int, cols: int) -> torch.Tensor:
        need = rows * cols
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            if fits:
                base = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                return base[:need].view(rows, cols)
        return torch.empty(need).view(rows, cols)

    def give(self, buffer: torch.Tensor) -> None:
        base = buffer._base if buffer._base is not None else buffer
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(base.view(-1))


class SoftmaxPartials(torch.autograd.Function):
    """One shard's share of a softmax cross-entropy over a vocabulary split across shards.

    Returns per token the log-sum-exp of this shard's logits and the target's logit where the shard
    owns the target (0 elsewhere); the trainer combines them into the loss, so no [tokens, vocab]
    tensor crosses RPC. ``weight_snapshot``/``bias_snapshot`` are private copies: other trainers'
    optimizer steps change the live parameters in place between this forward and its backward.

    The [tokens, rows] buffer is memory-bound work, so it is touched as few times as possible, in
    place: logits, then exp(logits - max), kept for backward with its row sums.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, weight_snapshot, bias_snapshot, local_target, owned, pool, needs_backward):
        buf = pool.take(h.size(0), weight_snapshot.size(0))
        torch.mm(h, weight_snapshot.t(), out=buf).add_(bias_snapshot)       # logits [N, rows]
        target_logit = buf.gather(1, local_target.unsqueeze(1)).squeeze(1) * owned
        row_max = buf.amax(dim=1)
        buf.sub_(row_max.unsqueeze(1)).exp_()                                 # e = exp(logits - max)
        row_sum = buf.sum(dim=1)
        lse = row_max + row_sum.log()
        if not needs_backward:  # evaluation: nothing will come back for the buffer
            pool.give(buf)
            return lse, target_logit
        ctx.save_for_backward(h, weight_snapshot, local_target, owned, row_sum)
        ctx.buf, ctx.pool = buf, pool
        return lse, target_logit

    @staticmethod
    def backward(ctx, grad_lse, grad_target):
        h, weight, local_target, owned, row_sum = ctx.saved_tensors
        grad_logits = ctx.buf.mul_((grad_lse / row_sum).unsqueeze(1))         # softmax * dL/dlse
        grad_logits.scatter_add_(1, local_target.unsqueeze(1), (grad_target * owned).unsqueeze(1))
        grad_h = grad_logits @ weight
        grad_weight = grad_logits.t() @ h
        grad_bias = grad_logits.sum(0)
        ctx.pool.give(ctx.buf)
        ctx.buf = None
        return grad_h, grad_weight, grad_bias, None, None, None, None, None, None


class DecoderShard(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # [rows, nhid]
        self.bias = nn.Parameter(bias)      # [rows]
        self.pool = BufferPool()

    def partials(self, h: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor,
                 weight_snapshot: torch.Tensor, bias_snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return SoftmaxPartials.apply(h, self.weight, self.bias, weight_snapshot, bias_snapshot, local_target, owned,
                                     self.pool, torch.is_grad_enabled())


def combine_partials(lse_parts: list[torch.Tensor], target_parts: list[torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy from the shards' partial results."""
    lse = torch.logsumexp(torch.stack(lse_parts), dim=0)
    target_logit = torch.stack(target_parts).sum(0)
    return (lse - target_logit).mean()
