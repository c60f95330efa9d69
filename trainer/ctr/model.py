"""A DLRM-style click-through-rate model: what the servers host (``model_spec``), the trainer's
view of it (``DistributedDlrm``), and the one-process baseline that trains it (``LocalDlrm``).

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
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ps.spec.model import DenseGroup, Lifecycle, ModelSpec, Table
from ps.spec.rules import RuleOptimizer, UpdateRule, rule
from ps.client.stub import PsClient
from trainer.core.served import ServedModel
from trainer.ctr.config import CtrModelConfig
from ps.spec.hashing import hashed, normal, uniform
from trainer.ctr.synthetic import DENSE, Batch

_TABLE_SALT, _LAYER_SALT = 0x7AB1E, 0x1A7E2
COMPATIBLE = ("cardinalities", "dim", "bottom", "top", "table_rule", "optimizer", "hashed")   # a checkpoint must match these
INIT_SLICE = 1 << 20      # rows of a table built at a time


def interactions(cfg: CtrModelConfig) -> int:
    n = len(cfg.cardinalities) + 1
    return n * (n - 1) // 2


def table_name(table: int) -> str:
    """Criteo's name of a categorical feature: C1 … C26; its table's parameter is ``C<n>.weight``."""
    return f"C{table + 1}"


def table_rows(cfg: CtrModelConfig, table: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of table ``table`` as initialised: uniform in ±1/sqrt(rows), as DLRM does, each
    a pure function of (seed, table, id)."""
    rows = cfg.cardinalities[table]
    dims = np.arange(cfg.dim, dtype=np.int64)[None, :]
    u = uniform(hashed(cfg.seed, _TABLE_SALT, table, ids.numpy().astype(np.int64)[:, None], dims))
    bound = 1.0 / math.sqrt(rows)
    return torch.from_numpy((2.0 * u - 1.0) * bound).to(torch.float32)


def _mlp(sizes: Sequence[int], cfg: CtrModelConfig, salt: int, last_sigmoid: bool = False) -> nn.Sequential:
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

    def __init__(self, cfg: CtrModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.bottom = _mlp([DENSE, *cfg.bottom, cfg.dim], cfg, 0)
        self.top = _mlp([cfg.dim + interactions(cfg), *cfg.top, 1], cfg, 1)
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


def bags(batch: Batch) -> torch.Tensor:
    """[B, 26, K] the ids of each sample's bag per feature (K = 1: one id each)."""
    ids = torch.from_numpy(batch.ids)
    return ids.reshape(ids.shape[0], ids.shape[1], -1)


def model_spec(cfg: CtrModelConfig) -> ModelSpec:
    """What the servers host: a table per categorical feature (its rows built a slice at a time,
    from (seed, table, row)), placed and updated as ``cfg`` says, and the two MLPs as dense groups."""
    placement = "" if cfg.placement == "auto" else cfg.placement
    life = Lifecycle(admit_after=cfg.admit_after, evict_after_steps=cfg.evict_after_steps)
    capacity = dict(zip(cfg.hashed, cfg.capacities))
    tables = {table_name(t): Table(capacity.get(t, rows), {f"{table_name(t)}.weight": (cfg.dim,)},
                                   lambda ids, t=t: {f"{table_name(t)}.weight": table_rows(cfg, t, ids)},
                                   rule=cfg.table_rule, placement=placement,
                                   hashed=life if t in cfg.hashed else None, dtype=cfg.table_dtype,
                                   wire_dtype=cfg.wire_dtype)
              for t, rows in enumerate(cfg.cardinalities)}
    dense = DlrmDense(cfg)

    def weights(part: str) -> dict[str, torch.Tensor]:
        return {f"{part}.{n}": p.detach() for n, p in getattr(dense, part).named_parameters()}
    groups = tuple(DenseGroup({n: tuple(p.shape) for n, p in weights(part).items()},
                              lambda part=part: {n: p.clone() for n, p in weights(part).items()})
                   for part in ("bottom", "top"))
    return ModelSpec(tables, groups, optimizer=cfg.optimizer, lr=cfg.lr, meta=cfg.model_dump(mode="json"),
                     compatible=COMPATIBLE)


def pool(rows: torch.Tensor, pooling: str) -> torch.Tensor:
    """[B, K, D] a bag's rows -> [B, D]"""
    return rows.sum(dim=1) if pooling == "sum" else rows.mean(dim=1)


class DistributedDlrm(ServedModel):
    """The trainer's view: each step fetches every table's rows of the batch's ids (one request per
    server) and the MLPs' weights (unless replicated here), pools the bags, and computes the logits."""

    def __init__(self, client: PsClient) -> None:
        config = CtrModelConfig.model_validate(client.model)
        super().__init__(client, DlrmDense(config))
        self.config = config

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``ids`` [B, 26, K] -> (pooled rows [B, 26, D], the dense weights fetched)."""
        rows, weights = self.fetch_rows({f"{table_name(t)}.weight": ids[:, t, :] for t in range(ids.shape[1])})
        pooled = torch.stack([pool(rows[f"{table_name(t)}.weight"], self.config.pooling)
                              for t in range(ids.shape[1])], dim=1)
        return pooled, weights

    def logits(self, dense: torch.Tensor, pooled: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.run_dense(weights, dense, pooled)

    def fetch_for(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fetch(bags(batch))

    def loss(self, batch: Batch, fetched: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> torch.Tensor:
        pooled, weights = fetched
        return loss_of(self.logits(torch.from_numpy(batch.dense), pooled, weights), torch.from_numpy(batch.labels))

    def predict(self, batch: Batch) -> np.ndarray:
        with torch.no_grad():
            pooled, weights = self.fetch(bags(batch))
            return torch.sigmoid(self.logits(torch.from_numpy(batch.dense), pooled, weights)).numpy()


class LocalDlrm:
    """The one-process baseline: every table in memory as an ``EmbeddingBag`` with sparse
    gradients, stepped by the same update rules the servers use."""

    def __init__(self, cfg: CtrModelConfig, table_rule: Optional[UpdateRule] = None,
                 dense_rule: Optional[UpdateRule] = None, lr: Optional[float] = None) -> None:
        self.cfg = cfg
        table_rule = table_rule or rule(cfg.table_rule)
        dense_rule = dense_rule or rule(cfg.optimizer)
        lr = cfg.lr if lr is None else lr
        self.dense = DlrmDense(cfg)
        self.tables = nn.ModuleList()
        for t, rows in enumerate(cfg.cardinalities):
            bag = nn.EmbeddingBag(rows, cfg.dim, mode=cfg.pooling, sparse=True)
            with torch.no_grad():
                for start in range(0, rows, INIT_SLICE):       # a table at a time, in slices
                    ids = torch.arange(start, min(rows, start + INIT_SLICE))
                    bag.weight[start:start + len(ids)] = table_rows(cfg, t, ids)
            self.tables.append(bag)
        self.optimizer = RuleOptimizer([(bag.weight, table_rule) for bag in self.tables]
                                       + [(p, dense_rule) for p in self.dense.parameters()], lr)

    def logits(self, batch: Batch) -> torch.Tensor:
        ids = bags(batch)
        pooled = torch.stack([bag(ids[:, t, :]) for t, bag in enumerate(self.tables)], dim=1)
        return self.dense(torch.from_numpy(batch.dense), pooled)

    def step(self, batch: Batch) -> float:
        self.optimizer.zero_grad()
        loss = loss_of(self.logits(batch), torch.from_numpy(batch.labels))
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def eval(self) -> None:
        self.dense.eval()

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        return torch.sigmoid(self.logits(batch)).numpy()
