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
import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from rpcps.batch import Batch, Jagged
from rpcps.data.files import data_files
from rpcps.data.formats import RowStream, reader_of
from rpcps.data.lines import LineError, Lines, OverLines, check_files, quoted, text_of
from rpcps.schema import Numeric, Schema
from rpcps.tables import sized

FLOAT32_MAX = float(np.finfo(np.float32).max)   # a numeric value beyond it is inf in the model's float32
MEASURED_LINES = 10_000       # lines of the data's start that measure a standardized column's mean and std
CACHED_IDS = 1 << 20          # values whose ids a table keeps at hand (most lines repeat the hot values)


@dataclass
class Row:
    label: float
    numeric: list[Optional[float]]          # None where empty
    categorical: list                       # each categorical column's field as written, or a list column's items
                                            # (``values_of`` reads either)


class SchemaLines:
    """Reads lines as ``schema`` says: ``header(line, where)`` for a file's first line when the
    files have one, then ``__call__(line, where)`` for each data line."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self._width = 0
        if schema.columns is not None:
            self._place(list(schema.columns))
        self._log1p = [j for j, n in enumerate(schema.numeric) if n.log1p]

    def _place(self, names: list[str]) -> None:
        """Where each column the schema uses is, in a line of columns ``names``."""
        at = {name: i for i, name in enumerate(names)}
        s = self.schema
        self._width, self._label = len(names), at[s.label]
        self._numeric = [at[n.column] for n in s.numeric]
        self._categorical = [at[c.column] for c in s.categorical]

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
        self._place(names)

    def __call__(self, line: bytes | int, where: str) -> Row:
        fields = self.split(text_of(line, where))
        if len(fields) != self._width:
            raise LineError(f"{where}: expected {self._width} {self.schema.format.upper()} fields, found {len(fields)}")
        label = fields[self._label]
        try:
            value = float(label)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise LineError(f"{where}: the label {self.schema.label} must be a number in [0, 1], got {quoted(label)}")
        return Row(value, self._numbers([fields[i] for i in self._numeric], where),
                   [fields[i] for i in self._categorical])

    def _numbers(self, texts: list[str], where: str) -> list[Optional[float]]:
        """The numeric columns' values (None where empty): a whole line's at once while every one is
        a plain finite number (the common case), else one by one for the sentence."""
        try:
            values = [float(t) if t and not t.isspace() else None for t in texts]
            if sum(abs(v) for v in values if v is not None) <= FLOAT32_MAX:     # False for inf and NaN too
                if not any(values[j] is not None and values[j] <= -1 for j in self._log1p):
                    return values
        except ValueError:
            pass
        return checked_numbers(self.schema, [_number(t, n.column, where) for t, n in zip(texts, self.schema.numeric)],
                               where)


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
    if abs(value) > FLOAT32_MAX:
        raise LineError(f"{where}: column {column} is {quoted(text)}, beyond float32's range (±{FLOAT32_MAX:.4g}), "
                        f"which the model computes in")
    return value


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


@dataclass(frozen=True)
class Occupancy:
    """How a table's rows hold the distinct values some rows named: a plain table's value takes row
    ``hash % rows``, so values share rows well below ``rows``; a vocabulary's values have rows of
    their own and every other value shares row 0; a hashed table keys rows by the 64-bit hash
    itself (``rows`` 0)."""

    table: str
    rows: int
    distinct: int           # distinct values named
    rows_used: int          # the rows they take
    sharing: int            # values on a row another value takes too

    @property
    def sharing_share(self) -> float:
        return self.sharing / self.distinct if self.distinct else 0.0


def named(schema: Schema, rows: Iterable[Row]) -> dict[str, Counter]:
    """Per table, how often ``rows`` name each value (every feature that uses it)."""
    counts: dict[str, Counter] = {t.name: Counter() for t in schema.tables}
    features = [(j, c.separator, counts[c.table_name]) for j, c in enumerate(schema.categorical)]
    for r in rows:
        for j, separator, counted in features:
            counted.update(values_of(r.categorical[j], separator))
    return counts


def vocabularies(schema: Schema, counts: dict[str, Counter]) -> Schema:
    """``schema`` with each vocabulary table's ``values`` from ``counts`` (``named``): those named
    ``min_count`` times at least, the most named first (ties in the values' order), ``rows`` - 1
    at most when ``rows`` is given (else ``rows`` sized by them). A table whose values are given
    keeps them."""
    tables = []
    for t in schema.tables:
        if t.vocabulary and t.values is None:
            kept = tuple(sorted((v for v, n in counts[t.name].items() if n >= t.min_count),
                                key=lambda v: (-counts[t.name][v], v))[:None if t.rows is None else t.rows - 1])
            t = t.model_copy(update={"values": kept, "rows": sized(len(kept)) if t.rows is None else t.rows})
        tables.append(t)
    return schema.model_copy(update={"tables": tuple(tables)})


def occupancy(schema: Schema, rows: Sequence[Row]) -> list[Occupancy]:
    """Per table, how its rows hold the values ``rows`` name (every feature that uses it); a
    vocabulary table's as its ``values``, or as the vocabulary of these rows would be."""
    counts = named(schema, rows)
    built = {t.name: t for t in vocabularies(schema, counts).tables}
    out = []
    for name, t in built.items():
        size = 0 if t.hashed else t.rows
        if t.vocabulary:
            inside = set(t.values)
            taken = Counter(v if v in inside else "" for v in counts[name])      # "": row 0, of every other value
        else:
            taken = Counter(value_id(name, v) % size if size else value_id(name, v) for v in counts[name])
        out.append(Occupancy(name, size, len(counts[name]), len(taken), sum(n for n in taken.values() if n > 1)))
    return out


def transformed(x: np.ndarray, n: Numeric) -> np.ndarray:
    """``x`` clipped and log1p'd as column ``n`` says (standardizing comes after)."""
    if n.clip is not None and n.clip != (None, None):
        x = np.clip(x, n.clip[0], n.clip[1])
    return np.log1p(x) if n.log1p else x


def clipped(value: float, clip: Optional[tuple[Optional[float], Optional[float]]]) -> float:
    low, high = clip or (None, None)
    value = value if low is None else max(value, low)
    return value if high is None else min(value, high)


def check(schema: Schema, paths: Sequence[Path], lines: int) -> None:
    """A ``LineError`` naming the first problem in the first ``lines`` records of each file, read
    in the schema's format."""
    reader_of(schema).check(schema, paths, lines)


def text_check(schema: Schema, paths: Sequence[Path], lines: int) -> None:
    """``check`` for CSV and TSV files."""
    reader = SchemaLines(schema)
    check_files(paths, reader, lines, header=reader.header if schema.header else None)


def rows_of(schema: Schema, paths: Sequence[Path], share: int = 0, shares: int = 1, start: int = 0,
            stop: Optional[int] = None, logged: bool = True) -> RowStream:
    """One share's rows of the files, read in the schema's format, from record ``start`` to ``stop``."""
    return reader_of(schema).rows(schema, paths, share, shares, start, stop, logged)


def text_rows(schema: Schema, paths: Sequence[Path], share: int = 0, shares: int = 1, start: int = 0,
              stop: Optional[int] = None, logged: bool = True) -> Lines:
    """``rows_of`` for CSV and TSV files: trainer ``share`` takes lines ``share``, ``+ shares``, …"""
    reader = SchemaLines(schema)
    return Lines(paths, reader, share, shares, start, stop, header=reader.header if schema.header else None,
                 logged=logged)


def measure(schema: Schema, paths: Sequence[Path], count: int = MEASURED_LINES,
            start: int = 0) -> dict[str, tuple[float, float]]:
    """The mean and std of each standardized column that gives none, over ``count`` data lines
    from line ``start`` (every trainer reads the same ones, so all standardize alike)."""
    wanted = [(j, n) for j, n in enumerate(schema.numeric) if n.standardize and n.mean is None]
    if not wanted:
        return {}
    rows = list(rows_of(schema, paths, start=start, stop=start + count, logged=False))
    out = {}
    for j, n in wanted:
        x = transformed(np.array([n.fill if r.numeric[j] is None else r.numeric[j] for r in rows], dtype=np.float64), n)
        std = float(x.std()) if len(x) else 1.0
        out[n.column] = (float(x.mean()) if len(x) else 0.0, std if std > 0 else 1.0)
    return out


def measured(schema: Schema, data: Optional[Path], start: int = 0) -> Schema:
    """``schema`` with the mean and std of each standardized column that gives none measured on
    ``data``'s lines from ``start``, as a trainer measures them (no ``data``: as it is)."""
    wanted = [n for n in schema.numeric if n.standardize and n.mean is None]
    if data is None or not wanted:
        return schema
    paths = data_files(data)
    if not paths:
        raise ValueError(f"--data {data}: no data files")
    stats = measure(schema, paths, start=start)
    numeric = tuple(n.model_copy(update=dict(zip(("mean", "std"), stats[n.column]))) if n in wanted else n
                    for n in schema.numeric)
    return schema.model_copy(update={"numeric": numeric})


@dataclass
class SchemaStream(OverLines):
    """Batches of one trainer's share of a schema's files, read once through (an epoch): what
    ``FileSource`` reads for a schema, as ``CriteoStream`` is for Criteo's format."""

    encoder: Encoder
    paths: Sequence[Path]
    share: int = 0
    shares: int = 1
    start: int = 0
    stop: Optional[int] = None
    _lines: RowStream = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lines = rows_of(self.encoder.schema, self.paths, self.share, self.shares, self.start, self.stop)

    @property
    def truncated(self) -> int:
        """Lists cut to their ``max_length`` so far, by this stream's encoder (every pass's)."""
        return self.encoder.truncated

    def batches(self, size: int) -> Iterator[Batch]:
        rows: list[Row] = []
        for row in self._lines:
            rows.append(row)
            if len(rows) == size:
                yield self.encoder.batch(rows)
                rows = []
        if rows:
            yield self.encoder.batch(rows)
