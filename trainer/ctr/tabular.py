"""A schema's CSV or TSV files (``rpcps/schema.py``), read as a stream of ``rpcps.Batch``es.

A line becomes a ``Row`` (``SchemaLines``): its label, its numeric values (None where empty) and
each categorical column's values as text, or a ``LineError`` naming the file, line and column.
``Encoder`` turns rows into a batch: numeric values filled, clipped, log1p'd and standardized;
categorical values hashed to 64-bit ids with their table's name, reduced modulo its rows unless
it is hashed, lists truncated to their ``max_length`` (counted). A record is one line: a quoted
field may hold the separator, not a line break.
"""
from __future__ import annotations

import csv
import functools
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from rpcps.batch import Batch, Jagged
from rpcps.schema import Schema
from trainer.core.lines import LineError, Lines, check_files, quoted, text_of

MEASURED_LINES = 10_000       # lines of the data's start that measure a standardized column's mean and std


@dataclass
class Row:
    label: float
    numeric: list[Optional[float]]          # None where empty
    categorical: list[list[str]]            # each column's values ([] where empty), untruncated


class SchemaLines:
    """Reads lines as ``schema`` says: ``header(line, where)`` for a file's first line when the
    files have one, then ``__call__(line, where)`` for each data line."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self._index: Optional[dict[str, int]] = None if schema.header else \
            {name: i for i, name in enumerate(schema.columns or ())}
        self._width = len(schema.columns) if schema.columns is not None else 0

    def split(self, text: str) -> list[str]:
        d = self.schema.delimiter
        return text.split(d) if '"' not in text else next(csv.reader([text], delimiter=d))

    def header(self, line: bytes | int, where: str) -> None:
        names = [n.strip() for n in self.split(text_of(line, where))]
        if self.schema.columns is not None and tuple(names) != self.schema.columns:
            raise LineError(f"{where}: the header names the columns {quoted(','.join(names), 200)}, but the schema's "
                            f"`columns` are {','.join(self.schema.columns)}")
        missing = [c for c in self.schema.used_columns if c not in names]
        if missing:
            raise LineError(f"{where}: the header has no column {', '.join(missing)} "
                            f"(it has {quoted(', '.join(names), 200)})")
        self._index, self._width = {name: i for i, name in enumerate(names)}, len(names)

    def __call__(self, line: bytes | int, where: str) -> Row:
        fields = self.split(text_of(line, where))
        if len(fields) != self._width:
            raise LineError(f"{where}: expected {self._width} {self.schema.format.upper()} fields, found {len(fields)}")
        at, s = self._index, self.schema
        try:
            label = _number(fields[at[s.label]], s.label, where)
        except LineError:
            label = None
        if label is None or not 0.0 <= label <= 1.0:
            raise LineError(f"{where}: the label {s.label} must be a number in [0, 1], got "
                            f"{quoted(fields[at[s.label]])}")
        numeric = []
        for n in s.numeric:
            value = _number(fields[at[n.column]], n.column, where)
            if value is not None and n.log1p and (min(max(value, n.clip[0]), n.clip[1]) if n.clip else value) <= -1:
                raise LineError(f"{where}: column {n.column} takes log1p, which needs a value above -1, got {value:g}")
            numeric.append(value)
        lists = []
        for c in s.categorical:
            value = fields[at[c.column]].strip()
            lists.append([] if not value else [value] if c.separator is None
                         else [v for v in (item.strip() for item in value.split(c.separator)) if v])
        return Row(label, numeric, lists)


def _number(text: str, column: str, where: str) -> Optional[float]:
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise LineError(f"{where}: column {column} is not a number: {quoted(text)}") from None
    if not math.isfinite(value):
        raise LineError(f"{where}: column {column} is not a finite number: {quoted(text)}")
    return value


@functools.lru_cache(maxsize=1 << 20)
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
        missing = [n.column for n in self.schema.numeric if n.standardize and n.mean is None
                   and n.column not in self.stats]
        if missing:
            raise ValueError(f"standardized column {', '.join(missing)} has no mean and std: measure them first")

    def numeric(self, rows: Sequence[Row]) -> torch.Tensor:
        out = np.empty((len(rows), len(self.schema.numeric)), dtype=np.float64)
        for j, n in enumerate(self.schema.numeric):
            x = np.array([n.fill if r.numeric[j] is None else r.numeric[j] for r in rows], dtype=np.float64)
            x = transformed(x, n)
            if n.standardize:
                mean, std = (n.mean, n.std) if n.mean is not None else self.stats[n.column]
                x = (x - mean) / std
            out[:, j] = x
        return torch.from_numpy(out.astype(np.float32))

    def batch(self, rows: Sequence[Row]) -> Batch:
        sparse = {}
        for j, c in enumerate(self.schema.categorical):
            table, size = self._tables[j]
            lists = [r.categorical[j] for r in rows]
            over = sum(len(values) > c.max_length for values in lists)
            if over:
                self.truncated += over
                lists = [values[:c.max_length] for values in lists]
            ids = [value_id(table, v) for values in lists for v in values]
            if size:
                ids = [i % size for i in ids]
            lengths = torch.tensor([len(values) for values in lists], dtype=torch.int64)
            sparse[c.name] = Jagged(torch.tensor(ids, dtype=torch.int64),
                                    torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
        return Batch(sparse, self.numeric(rows), torch.tensor([r.label for r in rows], dtype=torch.float32))


def transformed(x: np.ndarray, n) -> np.ndarray:
    """``x`` clipped and log1p'd as column ``n`` says (standardizing comes after)."""
    if n.clip is not None:
        x = np.clip(x, n.clip[0], n.clip[1])
    return np.log1p(x) if n.log1p else x


def check(schema: Schema, paths: Sequence[Path], lines: int) -> None:
    """A ``LineError`` naming the first problem in the first ``lines`` lines of each file."""
    reader = SchemaLines(schema)
    check_files(paths, reader, lines, header=reader.header if schema.header else None)


def rows_of(schema: Schema, paths: Sequence[Path], share: int = 0, shares: int = 1, start: int = 0,
            stop: Optional[int] = None, logged: bool = True) -> Lines:
    """One share's rows of the files, from data line ``start`` to ``stop``."""
    reader = SchemaLines(schema)
    return Lines(paths, reader, share, shares, start, stop, header=reader.header if schema.header else None,
                 logged=logged)


def measure(schema: Schema, paths: Sequence[Path], count: int = MEASURED_LINES) -> dict[str, tuple[float, float]]:
    """The mean and std of each standardized column that gives none, over the first ``count``
    data lines (every trainer reads the same ones, so all standardize alike)."""
    wanted = [(j, n) for j, n in enumerate(schema.numeric) if n.standardize and n.mean is None]
    if not wanted:
        return {}
    rows = list(rows_of(schema, paths, stop=count, logged=False))
    out = {}
    for j, n in wanted:
        x = transformed(np.array([n.fill if r.numeric[j] is None else r.numeric[j] for r in rows], dtype=np.float64), n)
        std = float(x.std()) if len(x) else 1.0
        out[n.column] = (float(x.mean()) if len(x) else 0.0, std if std > 0 else 1.0)
    return out


@dataclass
class SchemaStream:
    """Batches of one trainer's share of a schema's files, read once through (an epoch): what
    ``FileSource`` reads for a schema, as ``CriteoStream`` is for Criteo's format."""

    encoder: Encoder
    paths: Sequence[Path]
    share: int = 0
    shares: int = 1
    start: int = 0
    stop: Optional[int] = None
    _lines: Lines = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lines = rows_of(self.encoder.schema, self.paths, self.share, self.shares, self.start, self.stop)

    @property
    def skipped(self) -> int:
        return self._lines.skipped

    @property
    def last_skip(self) -> Optional[str]:
        return self._lines.last_skip

    @property
    def lines(self) -> int:
        return self._lines.lines

    def batches(self, size: int) -> Iterator[Batch]:
        rows: list[Row] = []
        for row in self._lines:
            rows.append(row)
            if len(rows) == size:
                yield self.encoder.batch(rows)
                rows = []
        if rows:
            yield self.encoder.batch(rows)
