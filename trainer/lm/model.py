"""The word-level LSTM language model, two ways with the same math and the same initial parameters:

* ``DistributedLM``: the trainer's view. Embeddings, LSTM weights and the decoder live on the servers;
  each step fetches the current values and the loss comes from the shards' partial results.
* ``LocalLM``: the whole model in one process, the reference for equivalence tests and benchmarks.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from ps.modules import init_decoder, init_embedding, init_lstm_layer
from ps.optim import grad_sq_norm, make_optimizer
from ps.stub import PsClient
from ps.config import ModelConfig

Hidden = tuple[torch.Tensor, torch.Tensor]


def init_hidden(model: ModelConfig, batch_size: int) -> Hidden:
    """(h, c), each [nlayers, batch, nhid]"""
    z = torch.zeros(model.nlayers, batch_size, model.nhid)
    return z, z.clone()


class _Body(nn.Module):
    """Dropout, LSTM, dropout: the part of a step both models compute in the trainer's process."""

    def __init__(self, model: ModelConfig, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.lstm = nn.LSTM(model.emsize, model.nhid, model.nlayers, dropout=dropout)

    def run(self, emb: torch.Tensor, hidden: Hidden, weights: Optional[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, Hidden]:
        """emb [bptt, batch, emsize] -> output [bptt*batch, nhid]"""
        x = F.dropout(emb, self.dropout, self.training)
        if weights is None:
            out, hidden = self.lstm(x, hidden)
        else:
            out, hidden = functional_call(self.lstm, weights, (x, hidden))
        out = F.dropout(out, self.dropout, self.training)
        return out.reshape(-1, out.size(-1)), hidden


class DistributedLM(nn.Module):
    def __init__(self, client: PsClient, dropout: float) -> None:
        super().__init__()
        self.client = client
        self.body = _Body(client.model, dropout)
        for p in self.body.parameters():
            p.requires_grad_(False)  # a skeleton only: the weights used are the servers'

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The servers' current embeddings of ``ids`` and LSTM weights."""
        return self.client.fetch(ids)

    def compute(self, emb: torch.Tensor, weights: dict[str, torch.Tensor], targets: torch.Tensor,
                hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        out, hidden = self.body.run(emb, hidden, weights)
        return self.client.loss(out, targets.reshape(-1)), hidden

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        return self.compute(*self.fetch(ids), targets, hidden)


class LocalLM(nn.Module):
    def __init__(self, model: ModelConfig, dropout: float) -> None:
        super().__init__()
        self.model_config = model
        self.embedding = nn.Embedding(model.ntoken, model.emsize, sparse=True)
        self.body = _Body(model, dropout)
        self.decoder = nn.Linear(model.nhid, model.ntoken)
        with torch.no_grad():
            self.embedding.weight.copy_(init_embedding(model))
            w, b = init_decoder(model)
            self.decoder.weight.copy_(w)
            self.decoder.bias.copy_(b)
            for layer in range(model.nlayers):
                for n, t in init_lstm_layer(model, layer).items():
                    getattr(self.body.lstm, n).copy_(t)
        self.optimizer = make_optimizer(model.optimizer, list(self.parameters()), model.lr)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        out, hidden = self.body.run(self.embedding(ids), hidden, None)
        return F.cross_entropy(self.decoder(out), targets.reshape(-1)), hidden

    def train_step(self, ids: torch.Tensor, targets: torch.Tensor, hidden: Hidden, clip: float) -> tuple[float, Hidden]:
        self.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, hidden = self(ids, targets, tuple(h.detach() for h in hidden))
        loss.backward()
        if clip > 0:
            # clip_grad_norm_ rejects the sparse embedding gradient; same rule as the servers'.
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            coef = clip / (grad_sq_norm(grads) ** 0.5 + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        self.optimizer.step()
        return float(loss), hidden
