"""Criteo-shaped click data that behaves like the real thing, generated, never stored.

- **Shape**: 13 dense count features and 26 categorical ones, with Criteo Kaggle's per-feature
  cardinalities (times ``scale``).
- **Ids**: per feature, a bounded power law over ranks, its exponent chosen so that the hottest 1 %
  of a big table's rows takes about 90 % of its lookups (as measured on Criteo), then a seeded
  affine permutation of ranks to ids, so hot rows are scattered over the servers.
- **Labels**: drawn from a hidden ground-truth model: a weight per (feature, id), a 4-vector per
  (feature, id) whose dot products over a few feature pairs add interactions, and weights on the
  dense features' ``log1p``. Its scale is set for an oracle AUC of about 0.80 and its bias for a
  25.6 % click rate, so the best achievable AUC is known (``oracle``).
- **Determinism**: every value is a counter-based hash of (seed, sample index, field), so sample
  ``i`` is a pure function of (seed, i): trainers generate disjoint shares without talking, and a
  replay is bit-identical.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Iterator, Optional

import numpy as np
import torch

from rpcps.batch import Batch, Jagged

from ps.spec.hashing import hashed, normal, uniform
from rpcps.quality import expected_auc

# Criteo Kaggle: distinct values of C1..C26 (no frequency threshold); 33,762,577 rows in all.
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
DENSE = 13
CATEGORICAL = len(KAGGLE_CARDINALITIES)    # 26
CLICK_RATE = 0.256          # Criteo Kaggle's share of positives
ORACLE_AUC = 0.80           # what the ground truth is scaled to
HEAD_ROWS, HEAD_SHARE = 0.01, 0.90
CALIBRATED_FROM = 1000      # tables at least this big get the 1 %/90 % skew; smaller ones a mild one
MILD_EXPONENT = 1.0
VECTOR = 4                  # the ground truth's interaction vectors
TEST_OFFSET = 1 << 40       # held-out samples are indices from here on: disjoint from any training share

# Salts of the hash streams: one per use, so no two draws share a random number.
_ID, _DENSE, _MISSING, _LABEL, _W, _V, _U, _MU, _PERM, _PAIRS, _RAW = range(1, 12)

def raw_ids(ids: np.ndarray, tables: "tuple[int, ...] | list[int]") -> np.ndarray:
    """Generated ids [B, 26, ...] with the columns of ``tables`` as the raw 64-bit values a hashed
    table is keyed by: a hash of (table, row), as a Criteo value's is of (feature, value)."""
    out = ids.copy()
    for t in tables:
        out[:, t] = hashed(_RAW, t, ids[:, t]).view(np.int64)
    return out


def head_share(exponent: float, rows: int, head: float = HEAD_ROWS) -> float:
    """The share of lookups the hottest ``head`` of ``rows`` ranks take under the bounded power
    law with this exponent (continuous approximation over [1, rows + 1))."""
    k = max(1.0, head * rows)
    if abs(exponent - 1.0) < 1e-9:
        return math.log(k + 1) / math.log(rows + 1)
    e = 1.0 - exponent
    return ((k + 1) ** e - 1.0) / ((rows + 1) ** e - 1.0)


def calibrated_exponent(rows: int) -> float:
    """The exponent that gives the hottest 1 % of ``rows`` 90 % of lookups (bisection)."""
    if rows < CALIBRATED_FROM:
        return MILD_EXPONENT
    lo, hi = 0.01, 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if head_share(mid, rows) < HEAD_SHARE else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Samples:
    dense: np.ndarray       # [B, 13] float32: log1p of the counts (missing: 0)
    ids: np.ndarray         # [B, 26] int64: row ids, each below its table's size (a hashed table's: raw ids)
    labels: np.ndarray      # [B] float32, 0 or 1
    p: np.ndarray           # [B] float64: the ground truth's click probability
    counts: np.ndarray      # [B, 13] int64: the raw counts, -1 where missing


@dataclass(frozen=True)
class SyntheticCtr:
    seed: int = 1
    scale: float = 1.0               # times Criteo Kaggle's cardinalities
    missing: float = 0.1             # share of dense fields left empty, as in Criteo

    @classmethod
    def fitting(cls, cardinalities: "tuple[int, ...] | list[int]", seed: int = 1) -> "SyntheticCtr":
        """The generator whose tables are ``cardinalities`` (Criteo Kaggle's at some scale, as its
        biggest table says), or ``ValueError`` when no scale gives them."""
        biggest = max(range(len(KAGGLE_CARDINALITIES)), key=KAGGLE_CARDINALITIES.__getitem__)
        if len(cardinalities) == len(KAGGLE_CARDINALITIES):
            ratio = cardinalities[biggest] / KAGGLE_CARDINALITIES[biggest]
            for scale in (float(f"{ratio:.3g}"), float(f"{ratio:.6g}"), ratio):   # as given, before rounding
                generator = cls(seed=seed, scale=scale)
                if generator.cardinalities == tuple(cardinalities):
                    return generator
        raise ValueError(f"tables of {list(cardinalities)} rows are not Criteo Kaggle's at any scale")

    @cached_property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(max(2, round(c * self.scale)) for c in KAGGLE_CARDINALITIES)

    @cached_property
    def exponents(self) -> np.ndarray:
        return np.array([calibrated_exponent(c) for c in self.cardinalities])

    @cached_property
    def _permutation(self) -> tuple[np.ndarray, np.ndarray]:
        """Per field, rank r goes to id (a·r + b) mod C, with a coprime to C."""
        mult, add = [], []
        for f, c in enumerate(self.cardinalities):
            h = int(hashed(self.seed, _PERM, f))
            a = 1 + h % (c - 1) if c > 2 else 1
            while math.gcd(a, c) != 1:
                a += 1
            mult.append(a)
            add.append(int(hashed(self.seed, _PERM, f, 1)) % c)
        return np.array(mult, dtype=np.int64), np.array(add, dtype=np.int64)

    @cached_property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The feature pairs whose interaction the ground truth uses: among the big tables, so the
        interaction carries signal a model can learn."""
        big = [f for f, c in enumerate(self.cardinalities) if c >= 100]
        h = [int(x) for x in hashed(self.seed, _PAIRS, np.arange(16))]
        out: list[tuple[int, int]] = []
        for i in range(0, 16, 2):
            f, g = sorted((big[h[i] % len(big)], big[h[i + 1] % len(big)]))
            if f != g and (f, g) not in out:
                out.append((f, g))
            if len(out) == 4:
                break
        return tuple(out)

    def ids(self, indices: np.ndarray, draw: int = 0) -> np.ndarray:
        """[B, 26] row ids of the samples ``indices``: their ranks, permuted. ``draw`` > 0: another
        id per feature from the same distribution (a bag's further ids, which labels ignore)."""
        mult, add = self._permutation
        sizes = np.array(self.cardinalities, dtype=np.int64)[None, :]
        return (mult[None, :] * self.ranks(indices, draw) + add[None, :]) % sizes

    def bag_ids(self, indices: np.ndarray, hot: int) -> np.ndarray:
        """[B, 26, hot] a bag of ``hot`` ids per feature: the sample's id, then further draws."""
        return np.stack([self.ids(indices, draw) for draw in range(hot)], axis=2)

    def ranks(self, indices: np.ndarray, draw: int = 0) -> np.ndarray:
        """[B, 26] popularity ranks (0: the hottest row of its table) of the samples ``indices``."""
        idx = np.asarray(indices, dtype=np.int64)[:, None]
        fields = np.arange(len(self.cardinalities), dtype=np.int64)[None, :]
        u = uniform(hashed(self.seed, _ID, idx, fields) if draw == 0 else hashed(self.seed, _ID, idx, fields, draw))
        rows = np.array(self.cardinalities, dtype=np.float64)[None, :]
        e = 1.0 - self.exponents[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            power = (1.0 + u * ((rows + 1.0) ** e - 1.0)) ** (1.0 / e)
        x = np.where(np.abs(e) < 1e-9, (rows + 1.0) ** u, power)
        return np.minimum(np.floor(x).astype(np.int64), np.array(self.cardinalities)[None, :]) - 1

    def counts(self, indices: np.ndarray) -> np.ndarray:
        """[B, 13] heavy-tailed counts (log-normal), -1 where the field is missing."""
        idx = np.asarray(indices, dtype=np.int64)[:, None]
        j = np.arange(DENSE, dtype=np.int64)[None, :]
        x = np.floor(np.exp(self._mu[None, :] + 1.5 * normal(hashed(self.seed, _DENSE, idx, j)))).astype(np.int64)
        gone = uniform(hashed(self.seed, _MISSING, idx, j)) < self.missing
        return np.where(gone, -1, np.minimum(x, 1 << 31))

    @cached_property
    def _mu(self) -> np.ndarray:
        """Per dense feature, the mean of its log count."""
        return 4.0 * uniform(hashed(self.seed, _MU, np.arange(DENSE, dtype=np.int64)))

    def _raw_logit(self, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
        fields = np.arange(ids.shape[1], dtype=np.int64)[None, :]
        z = normal(hashed(self.seed, _W, fields, ids)).sum(axis=1)
        for f, g in self.pairs:
            vf = normal(hashed(self.seed, _V, f, ids[:, f:f + 1], np.arange(VECTOR)[None, :]))
            vg = normal(hashed(self.seed, _V, g, ids[:, g:g + 1], np.arange(VECTOR)[None, :]))
            z += (vf * vg).sum(axis=1)
        u = normal(hashed(self.seed, _U, np.arange(DENSE)))
        return z + (features - self._mu[None, :]) @ u * 0.5

    @cached_property
    def _calibration(self) -> tuple[float, float]:
        """(scale, bias) of the logit: the scale for an oracle AUC of ORACLE_AUC, the bias for a
        CLICK_RATE click rate, fitted by bisection on 20,000 samples of their own index range."""
        idx = np.arange(20_000, dtype=np.int64) + (TEST_OFFSET << 1)
        z = self._raw_logit(self.ids(idx), np.log1p(np.maximum(self.counts(idx), 0)).astype(np.float64))

        def bias(scale: float) -> float:
            lo, hi = -20.0, 20.0
            for _ in range(50):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if _sigmoid(scale * z + mid).mean() < CLICK_RATE else (lo, mid)
            return (lo + hi) / 2

        lo, hi = 0.0, 5.0
        for _ in range(30):
            mid = (lo + hi) / 2
            low = expected_auc(_sigmoid(mid * z + bias(mid))) < ORACLE_AUC
            lo, hi = (mid, hi) if low else (lo, mid)
        scale = (lo + hi) / 2
        return scale, bias(scale)

    def batch(self, indices: np.ndarray, hot: int = 1) -> Samples:
        """The samples ``indices``; ``hot`` > 1: ids [B, 26, hot], bags whose first id is the one
        labels depend on."""
        idx = np.asarray(indices, dtype=np.int64)
        ids, counts = self.ids(idx), self.counts(idx)
        dense = np.log1p(np.maximum(counts, 0)).astype(np.float64)
        scale, bias = self._calibration
        p = _sigmoid(scale * self._raw_logit(ids, dense) + bias)
        labels = (uniform(hashed(self.seed, _LABEL, idx)) < p).astype(np.float32)
        if hot > 1:
            ids = np.concatenate([ids[:, :, None], self.bag_ids(idx, hot)[:, :, 1:]], axis=2)
        return Samples(dense.astype(np.float32), ids, labels, p, counts)

    @staticmethod
    def share(start: int, count: int, share: int, shares: int) -> np.ndarray:
        """Sample indices ``share`` of ``shares`` takes among [start, start + count): every
        ``shares``-th, so trainers' shares are disjoint and together the whole range."""
        return np.arange(start + share, start + count, shares, dtype=np.int64)

    def held_out(self, count: int) -> np.ndarray:
        return np.arange(TEST_OFFSET, TEST_OFFSET + count, dtype=np.int64)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


@dataclass(frozen=True)
class Scored(Batch):
    """A batch of the Criteo schema's features with the ground truth's click probability of each
    sample (NaN where not known, as in a file), for the held-out evaluation's best possible AUC."""

    p: Optional[np.ndarray] = None


def features(samples: Samples) -> Scored:
    """Generated or Criteo samples as the model takes them: feature ``C<t+1>`` the ids of column
    ``t`` (several a sample with ``--hot``: a bag), the counts' ``log1p`` as the dense columns."""
    ids = torch.from_numpy(samples.ids)
    size, hot = ids.shape[0], 1 if ids.dim() == 2 else ids.shape[2]
    by_feature = ids.reshape(size, CATEGORICAL, hot).permute(1, 0, 2).reshape(CATEGORICAL, size * hot)
    offsets = torch.arange(0, size * hot + 1, hot)
    return Scored({f"C{t + 1}": Jagged(by_feature[t], offsets) for t in range(CATEGORICAL)},
                  torch.from_numpy(samples.dense), torch.from_numpy(samples.labels), samples.p)


@dataclass
class GeneratedSource:
    """Trainer ``share`` of ``shares`` takes indices ``cursor + share``, ``+ shares``, … of the
    generator's stream: each step's batch of every trainer together is one range of the stream."""

    generator: SyntheticCtr
    batch_size: int
    share: int = 0
    shares: int = 1
    hot: int = 1
    cursor: int = 0          # the stream's samples passed (every trainer's share of them)
    skipped: int = 0         # nothing is ever malformed here
    truncated: int = 0       # nor too long
    hashed: tuple[int, ...] = ()     # tables whose ids are given raw (64-bit), for hashed tables

    @property
    def description(self) -> str:
        g = self.generator
        return f"generated Criteo-shaped data (seed {g.seed}, scale {g.scale:g}" + \
            (f", {self.hot} ids per feature)" if self.hot > 1 else ")")

    def next(self) -> Scored:
        return features(self.samples())

    def samples(self) -> Samples:
        """The next batch as generated (``next``: as the model takes it); the position moves past it."""
        indices = self.generator.share(self.cursor, self.batch_size * self.shares, self.share, self.shares)
        self.cursor += self.batch_size * self.shares
        return self._batch(indices)

    def ready(self, wait: float = 0.0) -> bool:
        return True

    def behind(self) -> Optional[tuple[int, float]]:
        return None

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def restore(self, states: list[dict[str, Any]], mine: Optional[dict[str, Any]]) -> str:
        from rpcps.data.source import redivided
        self.cursor = int(mine.get("cursor", 0)) if mine is not None else redivided(states)[0]
        return f"sample {self.cursor} of the stream"

    def held_out(self, count: int, batch_size: int) -> Iterator[Scored]:
        indices = self.generator.held_out(count)
        for start in range(0, count, batch_size):
            yield features(self._batch(indices[start:start + batch_size]))

    def _batch(self, indices: np.ndarray) -> Samples:
        batch = self.generator.batch(indices, self.hot)
        return replace(batch, ids=raw_ids(batch.ids, self.hashed)) if self.hashed else batch
