"""What a schema's data says of itself, read in the schema's format: the records themselves
(``rows_of``, ``check``), how its tables' rows would hold the values named (``named``,
``occupancy``), the vocabularies counted (``vocabularies``), and the standardized columns' mean
and std (``measure``, ``measured``)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from rpcps.data.encoding import Row, transformed, value_id, values_of
from rpcps.data.files import data_files
from rpcps.data.formats import RowStream, reader_of
from rpcps.schema import Schema
from rpcps.tables import sized

MEASURED_LINES = 10_000       # records of the data's start that measure a standardized column's mean and std


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


def check(schema: Schema, paths: Sequence[Path], lines: int) -> None:
    """A ``LineError`` naming the first problem in the first ``lines`` records of each file, read
    in the schema's format."""
    reader_of(schema).check(schema, paths, lines)


def rows_of(schema: Schema, paths: Sequence[Path], share: int = 0, shares: int = 1, start: int = 0,
            stop: Optional[int] = None, logged: bool = True) -> RowStream:
    """One share's rows of the files, read in the schema's format, from record ``start`` to ``stop``."""
    return reader_of(schema).rows(schema, paths, share, shares, start, stop, logged)


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
