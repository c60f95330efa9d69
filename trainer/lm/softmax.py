"""The language model's output layer split over the servers: each shard computes, for its slice of
the vocabulary, the log-sum-exp of its logits and the target's logit where it owns the target; the
trainer combines them into the cross-entropy. No [tokens, vocab] tensor crosses RPC, and the
decoder's work, most of a step, splits over the servers.

``Decode`` is the server-side operation the language model's ``ModelSpec`` names ``decode``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn

from services.remote import in_autograd_context
from ps.server.tables import BufferPool
from ps.spec.sharding import NO_ID
from services.errors import BadRequest
from services.remote import describe

if TYPE_CHECKING:     # it runs on a server; the trainers' side of the model never imports one
    from ps.server.service import ParameterServer

VOCABULARY = "vocabulary"     # the table of the embedding's and the decoder's rows
DECODER = ("decoder.weight", "decoder.bias")


class SoftmaxPartials(torch.autograd.Function):
    """One shard's share of a softmax cross-entropy over a vocabulary split across shards.

    Returns per token the log-sum-exp of this shard's logits and the target's logit where the shard
    owns the target (0 elsewhere). ``weight_snapshot``/``bias_snapshot`` are private copies: other
    trainers' optimizer steps change the live parameters in place between this forward and its
    backward.

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


class DecoderShard:
    """A shard's rows of the decoder, weight [rows, nhid] and bias [rows] (the server's own
    parameters, or new ones made of plain tensors)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, pool: Optional[BufferPool] = None) -> None:
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias)
        self.pool = pool or BufferPool()

    def partials(self, h: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor,
                 weight_snapshot: torch.Tensor, bias_snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return SoftmaxPartials.apply(h, self.weight, self.bias, weight_snapshot, bias_snapshot, local_target, owned,
                                     self.pool, torch.is_grad_enabled())


def combine_partials(lse_parts: list[torch.Tensor], target_parts: list[torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy from the shards' partial results."""
    lse = torch.logsumexp(torch.stack(lse_parts), dim=0)
    target_logit = torch.stack(target_parts).sum(0)
    return (lse - target_logit).mean()


class Decode:
    """``decode(h, targets)`` on a server: per token of ``h`` [N, nhid], this shard's log-sum-exp
    and its target logit (0 where it does not own the target)."""

    def __init__(self, nhid: int) -> None:
        self.nhid = nhid
        self._pool = BufferPool()     # one per server process: the op object lives in its ModelSpec

    def __call__(self, server: ParameterServer, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if len(args) != 2:
            raise BadRequest(f"decode takes (h, targets), got {len(args)} arguments")
        h, targets = args
        if not isinstance(h, torch.Tensor) or h.dtype != torch.float32 or h.dim() != 2 or h.size(1) != self.nhid:
            raise BadRequest(f"h must be a float32 tensor [N, {self.nhid}], got {describe(h)}")
        server.checks.ids(VOCABULARY, targets, "targets", any_shard=True)
        if targets.numel() != h.size(0):
            raise BadRequest(f"targets has {targets.numel()} entries for {h.size(0)} rows of h")
        plan = server.layout.plans[VOCABULARY]
        owned = plan.owner(targets) == server.shard
        local = torch.where(owned, plan.to_local(targets), torch.zeros_like(targets))
        decoder = DecoderShard(*(server.param(n) for n in DECODER), self._pool)
        w, b = server.snapshot(list(DECODER))
        # Rows of no id (an empty column's, past the vocabulary's end; only a grid has them) are
        # no word: a logit of -inf adds nothing to the sum of exponentials, nor takes any gradient.
        if plan.gridded:
            b = b.masked_fill(plan.global_ids(server.shard) == NO_ID, float("-inf"))
        # Outside a distributed autograd context (evaluation) nothing will ever call backward:
        # skip saving the [N, rows] probabilities.
        with torch.set_grad_enabled(in_autograd_context()):
            return decoder.partials(h, local, owned.to(h.dtype), w, b)
