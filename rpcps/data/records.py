"""Records as a source of your own receives them (a message queue's messages, a database's rows):
each a mapping of column to value, encoded into a batch exactly as the same line of a schema's
file would be, so a model trained on either sees the same ids and numbers.

A value is what a CSV field would hold, typed: a number (or None: empty) for the label and the
numeric columns; a string or an integer for a categorical column, or a list of them for a list
column (a string with the column's separator is split as in CSV). A record the schema cannot take
is a ``LineError`` naming the record and the column: skip it and count it, as the readers do.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from rpcps.batch import Batch
from rpcps.data.lines import LineError
from rpcps.data.encoding import checked_numbers, Encoder, Row
from rpcps.schema import Schema


class Records:
    """``schema``'s records to batches; ``stats``: the (mean, std) of standardized columns the
    schema gives none for (else they must be in the schema)."""

    def __init__(self, schema: Schema, stats: "Mapping[str, tuple[float, float]] | None" = None) -> None:
        self.schema = schema
        self.encoder = Encoder(schema, dict(stats or {}))

    @property
    def truncated(self) -> int:
        """Lists cut to their ``max_length`` so far."""
        return self.encoder.truncated

    def check(self, record: Mapping[str, Any], where: str = "record") -> None:
        """A ``LineError`` saying what is wrong with ``record`` (``where``: how to name it), if
        anything: a source skips and counts such a record, as the readers do."""
        self._row(record, where)

    def _row(self, record: Mapping[str, Any], where: str) -> Row:
        s = self.schema
        missing = [c for c in s.used_columns if c not in record]
        if missing:
            raise LineError(f"{where}: no column {', '.join(missing)}")
        label = _number(record[s.label], f"{where}: the label {s.label}")
        if label is None or not 0.0 <= label <= 1.0:
            raise LineError(f"{where}: the label {s.label} must be a number in [0, 1], got {record[s.label]!r}")
        numeric = checked_numbers(s, [_number(record[n.column], f"{where}: column {n.column}") for n in s.numeric],
                                  where)
        return Row(label, numeric, [_field(record[c.column]) for c in s.categorical])

    def batch(self, records: Sequence[Mapping[str, Any]]) -> Batch:
        """``records`` as one batch, or a ``LineError`` naming the first bad one (``check`` it first)."""
        return self.encoder.batch([self._row(r, f"record {i}") for i, r in enumerate(records)])


def _number(value: Any, what: str) -> "float | None":
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LineError(f"{what} is not a number: {value!r}")
    return float(value)


def _field(value: Any) -> "str | list[str]":
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if v is not None]
    return str(value)
