"""A DLRM-style click-through-rate model, and the one-process baseline that trains it.

The model: a bottom MLP over the 13 dense features down to the embedding dimension D; one pooled
embedding per categorical feature (a bag of ids, summed or averaged); the pairwise dot products of
those 27 vectors (the interaction); a top MLP over the bottom output and the interaction, to one
logit; binary cross-entropy.

Initial values are functions of (seed, table, row) and (seed, layer), never draws from a shared
generator, so any process can build any slice of any table and get the values the whole model has:
a server builds only its shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ps.rules import RuleOptimizer, UpdateRule, rule
from trainer.ctr.synthetic import DENSE, Batch, hashed, normal, uniform

_TABLE_SALT, _LAYER_SALT = 0x7AB1E, 0x1A7E2


@dataclass(frozen=True)
class DlrmConfig:
    cardinalities: tuple[int, ...]
    dim: int = 16
    bottom: tuple[int, ...] = (512, 256, 64)     # hidden sizes; the last layer gives ``dim``
    top: tuple[int, ...] = (512, 256)            # hidden sizes; the last layer gives one logit
    pooling: str = "sum"                         # of a bag's rows: "sum" or "mean"
    seed: int = 1

    @property
    def interactions(self) -> int:
        n = len(self.cardinalities) + 1
        return n * (n - 1) // 2


def table_rows(cfg: DlrmConfig, table: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of table ``table`` as initialised: uniform in ±1/sqrt(rows), as DLRM does, each
    a pure function of (seed, table, id)."""
    rows = cfg.cardinalities[table]
    dims = np.arange(cfg.dim, dtype=np.int64)[None, :]
    u = uniform(hashed(cfg.seed, _TABLE_SALT, table, ids.numpy().astype(np.int64)[:, None], dims))
    bound = 1.0 / math.sqrt(rows)
    return torch.from_numpy((2.0 * u - 1.0) * bound).to(torch.float32)


def _mlp(sizes: Sequence[int], cfg: DlrmConfig, salt: int, last_sigmoid: bool = False) -> nn.Sequential:
    """Linear layers with ReLU between, weights normal with DLRM's std sqrt(2 / (fan_in + fan_out)),
    from hashes of (seed, layer), so every process builds the same."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layer = nn.Linear(n_in, n_out)
        w = normal(hashed(cfg.seed, _LAYER_SALT, salt, i, np.arange(n_in * n_out, dtype=np.int64)))
        b = normal(hashed(cfg.seed, _LAYER_SALT, salt, i, -1 - np.arange(n_out, dtype=np.int64)))
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(w.reshape(n_out, n_in) * math.sqrt(2.0 / (n_in + n_out))))
            layer.bias.copy_(torch.from_numpy(b * math.sqrt(1.0 / n_out)))
        layers.append(layer)
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DlrmDense(nn.Module):
    """Everything but the tables: the bottom and top MLPs and the interaction between them."""

    def __init__(self, cfg: DlrmConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.bottom = _mlp([DENSE, *cfg.bottom, cfg.dim], cfg, 0)
        self.top = _mlp([cfg.dim + cfg.interactions, *cfg.top, 1], cfg, 1)
        n = len(cfg.cardinalities) + 1
        self._upper = torch.triu_indices(n, n, offset=1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """``dense`` [B, 13], ``pooled`` [B, 26, D]: logits [B]."""
        x = self.bottom(dense)
        t = torch.cat([x[:, None, :], pooled], dim=1)            # [B, 27, D]
        z = torch.bmm(t, t.transpose(1, 2))[:, self._upper[0], self._upper[1]]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels)


class LocalDlrm:
    """The one-process baseline: every table in memory as an ``EmbeddingBag`` with sparse
    gradients, stepped by the same update rules the servers use."""

    def __init__(self, cfg: DlrmConfig, table_rule: UpdateRule = rule("rowwise_adagrad"),
                 dense_rule: UpdateRule = rule("adagrad"), lr: float = 0.05) -> None:
        self.cfg = cfg
        self.dense = DlrmDense(cfg)
        self.tables = nn.ModuleList()
        for t, rows in enumerate(cfg.cardinalities):
            bag = nn.EmbeddingBag(rows, cfg.dim, mode=cfg.pooling, sparse=True)
            with torch.no_grad():
                for start in range(0, rows, 1 << 20):       # a table at a time, in slices
                    ids = torch.arange(start, min(rows, start + (1 << 20)))
                    bag.weight[start:start + len(ids)] = table_rows(cfg, t, ids)
            self.tables.append(bag)
        self.optimizer = RuleOptimizer([(bag.weight, table_rule) for bag in self.tables]
                                       + [(p, dense_rule) for p in self.dense.parameters()], lr)

    def logits(self, batch: Batch) -> torch.Tensor:
        ids = torch.from_numpy(batch.ids)
        pooled = torch.stack([bag(ids[:, t:t + 1]) for t, bag in enumerate(self.tables)], dim=1)
        return self.dense(torch.from_numpy(batch.dense), pooled)

    def step(self, batch: Batch) -> float:
        self.optimizer.zero_grad()
        loss = loss_of(self.logits(batch), torch.from_numpy(batch.labels))
        loss.backward()
        self.optimizer.step()
        return float(loss)

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        return torch.sigmoid(self.logits(batch)).numpy()
