"""A schema's CSV or TSV files (``rpcps/schema.py``): a line becomes a ``Row`` (``SchemaLines``)
or a ``LineError`` naming the file, line and column; ``SchemaStream`` is a trainer's share of them
as batches. A record is one line: a quoted field may hold the separator, not a line break."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from rpcps.batch import Batch
from rpcps.data.encoding import FLOAT32_MAX, Encoder, Row, checked_numbers
from rpcps.data.lines import LineError, Lines, OverLines, check_files, quoted, text_of
from rpcps.schema import Schema


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


def text_check(schema: Schema, paths: Sequence[Path], lines: int) -> None:
    """``check`` for CSV and TSV files."""
    reader = SchemaLines(schema)
    check_files(paths, reader, lines, header=reader.header if schema.header else None)


def text_rows(schema: Schema, paths: Sequence[Path], share: int = 0, shares: int = 1, start: int = 0,
              stop: Optional[int] = None, logged: bool = True) -> Lines:
    """``rows_of`` for CSV and TSV files: trainer ``share`` takes lines ``share``, ``+ shares``, …"""
    reader = SchemaLines(schema)
    return Lines(paths, reader, share, shares, start, stop, header=reader.header if schema.header else None,
                 logged=logged)


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
    _lines: Lines = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lines = text_rows(self.encoder.schema, self.paths, self.share, self.shares, self.start, self.stop)

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
