"""A schema's Parquet files (``format: parquet``), read with pyarrow as the same ``Row``s a CSV line
becomes, so the encoding, the bad-value rules and the batches are the text formats' own.

- **Columns by name**: a file needs every column the schema uses, in any order, among any others;
  only those are read.
- **Lists**: an Arrow list column is a multi-hot feature, its items the values (no separator);
  its ``max_length`` must be given, since the default of 1 would keep only a list's first item.
  A text column with a ``separator`` is split as in CSV.
- **Values**: an integer id reads as its digits, as the same id in a CSV line does, so a model
  trained on either format looks up the same rows. A null is an empty field.
- **Shares**: records, as for text: trainer ``k`` of ``n`` takes records ``k``, ``k + n``, … of the
  files in name order, however they were cut into row groups (one group a file, as pandas and
  pyarrow write by default, trains on any number of trainers), so a trainer's batches are those
  of the same rows in CSV. Each trainer decodes every row group's used columns and keeps its own
  (about 0.4 µs a record on this project's machine: at ``n`` trainers, ``n`` times that for each
  record it trains on). A position is the records passed (every share's), so held-out records
  and restarts work alike.
- **Bad input**: a record the schema cannot take (a label outside [0, 1], a number not finite)
  is skipped and counted, naming the file, record and column; a file that is not Parquet, lacks
  a column, or has a row group that cannot be decoded is skipped with its reason, never a crash.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np

from rpcps.data.lines import LineError, Skips
from rpcps.data.encoding import FLOAT32_MAX, checked_numbers, Row

if TYPE_CHECKING:
    import pyarrow
    import pyarrow.parquet
    from rpcps.batch import Batch
    from rpcps.schema import Schema

log = logging.getLogger(__name__)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:     # pragma: no cover - a dependency; met only where it was left out
        raise LineError("format: parquet reads files with pyarrow, which is not installed (pip install pyarrow)") \
            from None
    return pyarrow


def _opened(path: Path) -> "pyarrow.parquet.ParquetFile":
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise LineError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())[:200]})") from None


class _Columns:
    """How a file's columns are read as a schema says: which to read, and which are lists."""

    def __init__(self, schema: "Schema", file: "pyarrow.parquet.ParquetFile", path: Path) -> None:
        pa = _pyarrow()
        fields = {f.name: f.type for f in file.schema_arrow}
        missing = [c for c in schema.used_columns if c not in fields]
        if missing:
            raise LineError(f"{path}: has no column {', '.join(missing)} (it has {', '.join(fields)})")
        self.used = schema.used_columns
        self.lists = {c.column for c in schema.categorical if pa.types.is_list(fields[c.column])
                      or pa.types.is_large_list(fields[c.column])}
        unbounded = [c.column for c in schema.categorical if c.column in self.lists
                     and "max_length" not in c.model_fields_set]
        if unbounded:
            raise LineError(f"{path}: column {', '.join(unbounded)} holds lists: give its max_length in the schema "
                            f"(the most values a sample keeps)")
        for name in [schema.label, *(n.column for n in schema.numeric)]:
            kind = fields[name]
            if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
                    or pa.types.is_decimal(kind) or pa.types.is_null(kind)):
                raise LineError(f"{path}: column {name} holds {kind}, not numbers")


def _text(value: Any) -> str:
    """A categorical value as the text it would be in a CSV line."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _rows(schema: "Schema", columns: _Columns, table: "pyarrow.Table", where: str, numbers: Sequence[int]
          ) -> Iterator["Row | LineError"]:
    """Each record of ``table`` as a ``Row``, or the ``LineError`` saying why it cannot be one;
    ``numbers``: each one's record number in the file ``where``."""
    data = {name: table.column(name).to_pylist() for name in columns.used}
    labels = data[schema.label]
    numeric = [data[n.column] for n in schema.numeric]
    categorical = [[value if value is not None else [] for value in data[c.column]] if c.column in columns.lists
                   else data[c.column] for c in schema.categorical]
    lists = [c.column in columns.lists for c in schema.categorical]
    for i, label in enumerate(labels):
        at = f"{where}:{numbers[i]}"
        label = float(label) if label is not None else math.nan
        if not 0.0 <= label <= 1.0:
            yield LineError(f"{at}: the label {schema.label} must be a number in [0, 1], got {labels[i]!r}")
            continue
        values = [None if column[i] is None else float(column[i]) for column in numeric]
        if not sum(abs(v) for v in values if v is not None) <= FLOAT32_MAX or \
                any(v is not None and v <= -1 for v, n in zip(values, schema.numeric) if n.log1p):
            try:
                checked_numbers(schema, values, at)
            except LineError as exc:
                yield exc
                continue
        yield Row(label, values, [[_text(v) for v in column[i] if v is not None] if is_list else _text(column[i])
                                  for column, is_list in zip(categorical, lists)])


def check(schema: "Schema", paths: Sequence[Path], records: int) -> None:
    """A ``LineError`` naming the first problem in the first ``records`` records of each file: none
    given, not Parquet, a column missing or of the wrong kind, a record the schema cannot take,
    files of no record."""
    if not paths:
        raise LineError("no data files")
    found = 0
    for path in paths:
        file = _opened(path)
        columns = _Columns(schema, file, path)
        seen = 0
        for group in range(file.metadata.num_row_groups):
            if seen >= records:
                break
            try:
                table = file.read_row_group(group, columns=columns.used)
            except (OSError, _pyarrow().ArrowException) as exc:
                raise LineError(f"{path}: row group {group} cannot be decoded ({str(exc)[:200]})") from None
            for row in _rows(schema, columns, table.slice(0, records - seen), str(path),
                             range(seen + 1, records + 1)):
                if isinstance(row, LineError):
                    raise row
            seen += min(table.num_rows, records - seen)
        found += file.metadata.num_rows
    if not found:
        raise LineError(f"{paths[0] if len(paths) == 1 else paths[0].parent}: no records")


def count(schema: "Schema", paths: Sequence[Path], limit: int) -> int:
    """The records of the files, as their footers say (a file that cannot be read counts none)."""
    total = 0
    for path in paths:
        try:
            total += _opened(path).metadata.num_rows
        except LineError:
            continue
        if total >= limit:
            break
    return total


@dataclass
class _Groups(Skips):
    """One trainer's share (every ``shares``-th record) of the records of ``paths``, from record ``start`` to
    ``stop`` of them all; what cannot be read is skipped and counted (``Skips``)."""

    schema: "Schema"
    paths: Sequence[Path]
    share: int = 0
    shares: int = 1
    start: int = 0
    stop: Optional[int] = None
    lines: int = field(default=0, init=False)      # records of the files passed so far, every share's

    def _tables(self) -> Iterator[tuple["pyarrow.Table", _Columns, str, np.ndarray, np.ndarray]]:
        """This share's records of each row group in [start, stop): (those records, the file's
        columns, the file, each record's number in the file from 1, and its place among every
        file's records from 0)."""
        passed = 0
        for path in self.paths:
            try:
                file = _opened(path)
                columns = _Columns(self.schema, file, path)
            except LineError as exc:
                self.skip(f"{exc}: the whole file is skipped")
                continue
            in_file = 0
            for group in range(file.metadata.num_row_groups):
                size = file.metadata.row_group(group).num_rows
                begin, end = passed, passed + size if self.stop is None else min(passed + size, self.stop)
                passed, in_file = begin + size, in_file + size
                first = max(begin, self.start)
                places = np.arange(first + (self.share - first) % self.shares, end, self.shares)  # from 0, all files'
                if len(places):
                    try:
                        table = file.read_row_group(group, columns=columns.used)
                    except (OSError, _pyarrow().ArrowException) as exc:
                        self.skip(f"{path}: row group {group} cannot be decoded ({str(exc)[:200]}): its {size} "
                                  f"records are skipped")
                    else:
                        yield table.take(_pyarrow().array(places - begin)), columns, str(path), \
                            places - (passed - in_file) + 1, places
                if self.stop is not None and passed >= self.stop:
                    return


@dataclass
class ParquetRows(_Groups):
    """A share of Parquet files as ``Row``s, for what reads rows (``rpcps data check``, the
    statistics and vocabularies ``rpcps up`` measures); training reads ``ParquetStream``."""

    def __iter__(self) -> Iterator[Row]:
        for table, columns, path, numbers, places in self._tables():
            for row, place in zip(_rows(self.schema, columns, table, path, numbers), places):
                self.lines = int(place) + 1
                if isinstance(row, LineError):
                    self.skip(str(row))
                else:
                    yield row


@dataclass
class ParquetStream(_Groups):
    """A share of Parquet files as batches, column by column (no ``Row`` made): what a trainer
    reads, as ``SchemaStream`` is for text. ``encoder``: the schema's ``Encoder``."""

    encoder: Any = None

    @property
    def truncated(self) -> int:
        return self.encoder.truncated

    def batches(self, size: int) -> Iterator["Batch"]:
        pa = _pyarrow()
        pending: list[tuple["pyarrow.Table", np.ndarray]] = []      # records kept, and the position after each
        held = 0
        for table, columns, path, numbers, places in self._tables():
            bad = _bad(self.schema, table)
            for i in np.flatnonzero(bad):
                for row in _rows(self.schema, columns, table.slice(int(i), 1), path, [numbers[i]]):
                    self.skip(str(row) if isinstance(row, LineError) else f"{path}:{numbers[i]}: unreadable")
            kept = np.flatnonzero(~bad)
            pending.append((table.take(pa.array(kept)) if bad.any() else table, places[kept] + 1))
            held += len(kept)
            while held >= size:
                batch_table, after, pending = _take(pending, size)
                held -= size
                self.lines = int(after)
                yield _batch(self.encoder, columns, batch_table)
        if held:
            batch_table, after, _ = _take(pending, held)
            self.lines = int(after)
            yield _batch(self.encoder, columns, batch_table)


def _take(pending: list, size: int) -> tuple["pyarrow.Table", int, list]:
    """The first ``size`` records of the pieces ``pending``, the position after the last of them,
    and the pieces left."""
    pa = _pyarrow()
    taken, left, need = [], [], size
    for table, after in pending:
        if need <= 0:
            left.append((table, after))
        elif table.num_rows <= need:
            taken.append((table, after))
            need -= table.num_rows
        else:
            taken.append((table.slice(0, need), after[:need]))
            left.append((table.slice(need), after[need:]))
            need = 0
    whole = taken[0][0] if len(taken) == 1 else pa.concat_tables([t for t, _ in taken], promote_options="permissive")
    return whole, taken[-1][1][-1], left


def _floats(column: "pyarrow.ChunkedArray") -> np.ndarray:
    """A numeric column's values as float64, NaN where null."""
    pa = _pyarrow()
    return column.cast(pa.float64()).to_numpy()


def _bad(schema: "Schema", table: "pyarrow.Table") -> np.ndarray:
    """Which records the schema cannot take (``_rows`` says why, for those only)."""
    label = _floats(table.column(schema.label))
    bad = ~((label >= 0.0) & (label <= 1.0))            # NaN, a null label, fails both
    for n in schema.numeric:
        column = table.column(n.column)
        value = _floats(column)
        given = ~column.is_null().to_numpy(zero_copy_only=False)
        wrong = ~np.isfinite(value) | (np.abs(value) > FLOAT32_MAX)
        if n.log1p:
            low, high = n.clip or (None, None)
            wrong |= np.clip(value, low, high) <= -1 if (low, high) != (None, None) else value <= -1
        bad |= given & wrong
    return bad


def _batch(encoder: Any, columns: _Columns, table: "pyarrow.Table") -> "Batch":
    """Records the schema takes (``_bad`` found none wrong) as a batch, column by column."""
    import torch

    from rpcps.batch import Batch, Jagged
    schema, size = encoder.schema, table.num_rows
    dense = np.empty((size, len(schema.numeric)), dtype=np.float64)
    for j, n in enumerate(schema.numeric):
        value = _floats(table.column(n.column))
        dense[:, j] = np.where(np.isnan(value), n.fill, value)
    sparse = {}
    for j, c in enumerate(schema.categorical):
        texts, rows = _values(table.column(c.column), c.column in columns.lists, c.separator, size)
        counts = np.bincount(rows, minlength=size)
        if c.column in columns.lists or c.separator is not None:
            over = counts > c.max_length
            if over.any():
                encoder.truncated += int(over.sum())
                starts = np.cumsum(counts) - counts
                keep = np.arange(len(rows)) - starts[rows] < c.max_length
                texts, rows = texts.filter(_pyarrow().array(keep)), rows[keep]
                counts = np.minimum(counts, c.max_length)
        encoded = texts.dictionary_encode()
        ids = np.asarray(encoder.ids(j, encoded.dictionary.to_pylist()), dtype=np.int64)[encoded.indices.to_numpy()]
        offsets = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        sparse[c.name] = Jagged(torch.from_numpy(ids), torch.from_numpy(offsets))
    labels = torch.from_numpy(_floats(table.column(schema.label)).astype(np.float32))
    return Batch(sparse, encoder.dense(dense), labels)


def _values(column: "pyarrow.ChunkedArray", is_list: bool, separator: Optional[str], size: int
            ) -> tuple["pyarrow.Array", np.ndarray]:
    """A categorical column's values, as text trimmed, empty and null ones left out, and the
    record each belongs to (in order)."""
    pa = _pyarrow()
    import pyarrow.compute as pc
    column = column.combine_chunks()
    if is_list or separator is not None:
        if not is_list:
            column = pc.split_pattern(pc.utf8_trim_whitespace(column.cast(pa.string())), separator)
        lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
        items = pc.list_flatten(column)
        rows = np.repeat(np.arange(size), lengths)
    else:
        items, rows = column, np.arange(size)
    texts = pc.utf8_trim_whitespace(items.cast(pa.string()))
    keep = pc.fill_null(pc.greater(pc.utf8_length(texts), 0), False).to_numpy(zero_copy_only=False)
    if keep.all():
        return texts, rows
    return texts.filter(pa.array(keep)), rows[keep]
