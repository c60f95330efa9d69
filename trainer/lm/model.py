"""The word-level LSTM language model: what the servers host (``model_spec``), and the model two
ways with the same math and the same initial parameters:

* ``DistributedLM``: the trainer's view (a ``trainer.core.served.ServedModel``). Embeddings, LSTM
  weights and the decoder live on the servers; each step fetches the current values and the loss
  comes from the shards' partial results (``trainer/lm/softmax.py``).
* ``LocalLM``: the whole model in one process, the reference for equivalence tests and benchmarks.

Initialisation is defined for the whole model (one seeded stream per tensor), and each shard takes
its slice, so a sharded cluster starts from exactly the one-process model's parameters.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from ps.spec.model import DenseGroup, ModelSpec, Table
from ps.client.client import PsClient
from ps.spec.rules import grad_sq_norm, make_optimizer
from trainer.core.served import ServedModel
from trainer.lm.config import LmModelConfig
from trainer.lm.softmax import DECODER, VOCABULARY, Decode, combine_partials

Hidden = tuple[torch.Tensor, torch.Tensor]
EMBEDDING = "embedding.weight"
COMPATIBLE = ("ntoken", "emsize", "nhid", "nlayers", "optimizer")   # a checkpoint's model must match in these


def _generator(cfg: LmModelConfig, tag: str) -> torch.Generator:
    # One stream per tensor, so a shard can build its part without drawing everyone else's.
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(tag.encode()))


def init_embedding(cfg: LmModelConfig) -> torch.Tensor:
    """[ntoken, emsize]"""
    return torch.empty(cfg.ntoken, cfg.emsize).uniform_(-cfg.init_range, cfg.init_range, generator=_generator(cfg, "emb"))


def init_decoder(cfg: LmModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [ntoken, nhid], bias [ntoken]"""
    w = torch.empty(cfg.ntoken, cfg.nhid).uniform_(-cfg.init_range, cfg.init_range, generator=_generator(cfg, "dec"))
    return w, torch.zeros(cfg.ntoken)


def lstm_shapes(cfg: LmModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    inp = cfg.emsize if layer == 0 else cfg.nhid
    return {f"weight_ih_l{layer}": (4 * cfg.nhid, inp), f"weight_hh_l{layer}": (4 * cfg.nhid, cfg.nhid),
            f"bias_ih_l{layer}": (4 * cfg.nhid,), f"bias_hh_l{layer}": (4 * cfg.nhid,)}


def init_lstm_layer(cfg: LmModelConfig, layer: int) -> dict[str, torch.Tensor]:
    """nn.LSTM's own rule (uniform ±1/sqrt(nhid)), drawn from a per-layer stream."""
    g = _generator(cfg, f"lstm{layer}")
    k = 1.0 / math.sqrt(cfg.nhid)
    return {n: torch.empty(s).uniform_(-k, k, generator=g) for n, s in lstm_shapes(cfg, layer).items()}


def model_spec(cfg: LmModelConfig) -> ModelSpec:
    """What the servers host: one vocabulary table (embedding and decoder rows), an LSTM layer per
    dense group, and the decoder's sharded softmax as the ``decode`` operation."""
    def vocabulary(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        # A vocabulary is small: drawn whole, as the one-process model draws it, then sliced.
        whole = {EMBEDDING: init_embedding(cfg), **dict(zip(DECODER, init_decoder(cfg)))}
        return {name: value[ids] for name, value in whole.items()}

    table = Table(cfg.ntoken, {EMBEDDING: (cfg.emsize,), DECODER[0]: (cfg.nhid,), DECODER[1]: ()}, vocabulary)
    layers = tuple(DenseGroup(lstm_shapes(cfg, layer), lambda layer=layer: init_lstm_layer(cfg, layer))
                   for layer in range(cfg.nlayers))
    return ModelSpec({VOCABULARY: table}, layers, {"decode": Decode(cfg.nhid)}, cfg.optimizer, cfg.lr,
                     meta=cfg.model_dump(), compatible=COMPATIBLE)


def init_hidden(model: LmModelConfig, batch_size: int) -> Hidden:
    """(h, c), each [nlayers, batch, nhid]"""
    z = torch.zeros(model.nlayers, batch_size, model.nhid)
    return z, z.clone()


class _Body(nn.Module):
    """Dropout, LSTM, dropout: the part of a step both models compute in the trainer's process."""

    def __init__(self, model: LmModelConfig, dropout: float) -> None:
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


class _Forward(nn.Module):
    """The body as the dense weights' computation: what DDP runs under ``--dense allreduce``."""

    def __init__(self, body: _Body) -> None:
        super().__init__()
        self.body = body

    def forward(self, emb: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        return self.body.run(emb, hidden, None)


class DistributedLM(ServedModel):
    def __init__(self, client: PsClient, dropout: float) -> None:
        config = LmModelConfig.model_validate(client.model)
        body = _Body(config, dropout)
        super().__init__(client, body.lstm, _Forward(body))
        self.config = config

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The servers' current embeddings of ``ids`` and LSTM weights (unless this trainer holds
        a replica of them), in one parallel round."""
        rows, weights = self.fetch_rows({EMBEDDING: ids})
        return rows[EMBEDDING], weights

    def compute(self, emb: torch.Tensor, weights: dict[str, torch.Tensor], targets: torch.Tensor,
                hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        out, hidden = self.run_dense(weights, emb, hidden)
        partials = self.client.op("decode", out, targets.reshape(-1))
        return combine_partials([p[0] for p in partials], [p[1] for p in partials]), hidden

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, hidden: Hidden) -> tuple[torch.Tensor, Hidden]:
        return self.compute(*self.fetch(ids), targets, hidden)


class LocalLM(nn.Module):
    def __init__(self, model: LmModelConfig, dropout: float) -> None:
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
        return float(loss.detach()), hidden
