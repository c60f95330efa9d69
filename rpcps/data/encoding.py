"""Records to batches, whatever format they were read from: a record is a ``Row`` (its label, its
numeric values, None where empty, and each categorical column's values as text), and ``Encoder``
turns rows into a batch: numeric values filled, clipped, log1p'd and standardized; categorical
values hashed to 64-bit ids with their table's name, reduced modulo its rows unless it is hashed
(a vocabulary's values take their places), lists truncated to their ``max_length`` (counted)."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from rpcps.batch import Batch, Jagged
from rpcps.data.lines import LineError
from rpcps.schema import Numeric, Schema

FLOAT32_MAX = float(np.finfo(np.float32).max)   # a numeric value beyond it is inf in the model's float32
CACHED_IDS = 1 << 20          # values whose ids a table keeps at hand (most lines repeat the hot values)


@dataclass
class Row:
    label: float
    numeric: list[Optional[float]]          # None where empty
    categorical: list                       # each categorical column's field as written, or a list column's items
                                            # (``values_of`` reads either)


def checked_numbers(schema: Schema, values: list[Optional[float]], where: str) -> list[Optional[float]]:
    """``values`` (the numeric columns', None where empty), or a ``LineError`` naming the first a
    model cannot take: not finite, beyond float32, or not above -1 (after clip) where log1p'd."""
    for v, n in zip(values, schema.numeric):
        if v is None:
            continue
        if not math.isfinite(v):
            raise LineError(f"{where}: column {n.column} is not a finite number: {v!r}")
        if abs(v) > FLOAT32_MAX:
            raise LineError(f"{where}: column {n.column} is {v:g}, beyond float32's range (±{FLOAT32_MAX:.4g}), "
                            f"which the model computes in")
        if n.log1p and clipped(v, n.clip) <= -1:
            raise LineError(f"{where}: column {n.column} takes log1p, which needs a value above -1, got {v:g}")
    return values


def values_of(field: "str | list[str]", separator: Optional[str]) -> list[str]:
    """A categorical field's values: none where empty, a list's items without the empty ones (a
    Parquet list column's items as they are, a text field's split at ``separator``)."""
    if isinstance(field, list):
        return [item for item in (x.strip() for x in field) if item]
    if separator is None:
        return [v] if (v := field.strip()) else []
    return [item for item in (x.strip() for x in field.split(separator)) if item]


def value_id(table: str, value: str) -> int:
    """A categorical value's 64-bit id (signed): a hash of the value keyed by its table's name."""
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8, key=table.encode("utf-8")[:64]).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass
class Encoder:
    """Rows to a batch, as the schema says; ``stats``: the measured (mean, std) of standardized
    columns that give none; ``truncated``: lists cut to their ``max_length`` so far."""

    schema: Schema
    stats: dict[str, tuple[float, float]] = field(default_factory=dict)
    truncated: int = 0

    def __post_init__(self) -> None:
        tables = {t.name: t for t in self.schema.tables}
        # Per feature: its table's name, and its rows (0: hashed, the raw id itself).
        self._tables = [(c.table_name, 0 if tables[c.table_name].hashed else tables[c.table_name].rows)
                        for c in self.schema.categorical]
        self._known: dict[str, dict[str, int]] = {t: {} for t in tables}     # per table: value -> its row id
        unbuilt = [t.name for t in tables.values() if t.vocabulary and t.values is None]
        if unbuilt:
            raise ValueError(f"table {', '.join(unbuilt)} takes its vocabulary from the data, which rpcps up counts "
                             f"and records: give a role started alone the schema with its `values`")
        # A vocabulary's rows are its values' places, from 1; any other value reads row 0.
        self._vocabularies = {t.name: {v: i for i, v in enumerate(t.values, start=1)}
                              for t in tables.values() if t.vocabulary}
        missing = [n.column for n in self.schema.numeric if n.standardize and n.mean is None
                   and n.column not in self.stats]
        if missing:
            raise ValueError(f"standardized column {', '.join(missing)} has no mean and std: measure them first")

    def _ids(self, table: str, size: int, values: list[str]) -> list[int]:
        """The row ids of ``values`` in ``table`` (of ``size`` rows; 0: hashed, the raw ids)."""
        vocabulary = self._vocabularies.get(table)
        if vocabulary is not None:
            return [vocabulary.get(v, 0) for v in values]
        known = self._known[table]
        try:
            return [known[v] for v in values]
        except KeyError:
            if len(known) > CACHED_IDS:
                known.clear()
            for v in values:
                if v not in known:
                    raw = value_id(table, v)
                    known[v] = raw % size if size else raw
            return [known[v] for v in values]

    def ids(self, j: int, values: list[str]) -> list[int]:
        """The row ids of categorical feature ``j``'s ``values`` in its table."""
        return self._ids(*self._tables[j], values)

    def numeric(self, rows: Sequence[Row]) -> torch.Tensor:
        fills = [n.fill for n in self.schema.numeric]
        return self.dense(np.array([[f if v is None else v for v, f in zip(r.numeric, fills)] for r in rows],
                                   dtype=np.float64).reshape(len(rows), len(fills)))

    def dense(self, out: np.ndarray) -> torch.Tensor:
        """``Batch.dense`` of the numeric columns' values ``out`` ([samples, columns], empty ones
        filled): clipped, log1p'd and standardized as the schema says. ``out`` is overwritten."""
        for j, n in enumerate(self.schema.numeric):
            x = transformed(out[:, j], n)
            if n.standardize:
                mean, std = (n.mean, n.std) if n.mean is not None else self.stats[n.column]
                x = (x - mean) / std
            out[:, j] = x
        return torch.from_numpy(out.astype(np.float32))

    def batch(self, rows: Sequence[Row]) -> Batch:
        sparse = {}
        for j, c in enumerate(self.schema.categorical):
            table, size = self._tables[j]
            if c.separator is None and not isinstance(rows[0].categorical[j], list):   # one value a sample
                texts = [r.categorical[j].strip() for r in rows]
                if "" in texts:
                    values, counts = [t for t in texts if t], [1 if t else 0 for t in texts]
                else:
                    values, counts = texts, None
            else:
                lists = [values_of(r.categorical[j], c.separator) for r in rows]
                over = sum(len(values) > c.max_length for values in lists)
                if over:
                    self.truncated += over
                    lists = [values[:c.max_length] for values in lists]
                values, counts = [v for values in lists for v in values], [len(v) for v in lists]
            ids = self._ids(table, size, values)
            lengths = torch.ones(len(rows), dtype=torch.int64) if counts is None else torch.tensor(counts)
            sparse[c.name] = Jagged(torch.tensor(ids, dtype=torch.int64),
                                    torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
        return Batch(sparse, self.numeric(rows), torch.tensor([r.label for r in rows], dtype=torch.float32))


def transformed(x: np.ndarray, n: Numeric) -> np.ndarray:
    """``x`` clipped and log1p'd as column ``n`` says (standardizing comes after)."""
    if n.clip is not None and n.clip != (None, None):
        x = np.clip(x, n.clip[0], n.clip[1])
    return np.log1p(x) if n.log1p else x


def clipped(value: float, clip: Optional[tuple[Optional[float], Optional[float]]]) -> float:
    low, high = clip or (None, None)
    value = value if low is None else max(value, low)
    return value if high is None else min(value, high)
