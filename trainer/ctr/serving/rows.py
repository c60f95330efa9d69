"""A /predict request's rows, checked and made into a batch as the same lines of a training file
would be read, so a row answers as training saw it. Two formats, as the model was trained:

* ``SchemaRows``: a model over a feature schema's files (CSV, TSV or Parquet) (a user's, or an example's);
* ``CriteoRows``: the built-in DLRM, trained on Criteo-format files: the 13 counts ``I1``..``I13``
  (integers) and the 26 values ``C1``..``C26`` (1 to 8 hexadecimal digits) of a Criteo line.

A row is a JSON object with every column the model reads but the label (others are ignored).
``null`` is an empty field: a numeric column takes its ``fill``, a categorical one has no id. A
numeric value is a number; a categorical one a string or an integer (``12`` reads as the field
``12``); a list column's value a list of them, or one string joined by its separator, of at most
``max_length`` values (a training file's longer list is truncated; a request's is refused, since
its sender can say what it meant).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Generic, Optional, Sequence, TypeVar

from rpcps.batch import Batch
from rpcps.data.criteo import CATEGORICAL, CriteoError, Parsed, batch_of, parse
from rpcps.data.generated import DENSE, features
from rpcps.data.encoding import FLOAT32_MAX, clipped, Encoder, Row, values_of
from rpcps.schema import Categorical, Numeric, Schema
from services.errors import ConfigError, InvalidInput

R = TypeVar("R")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class RowFormat(Generic[R]):
    """``rows(body)``: a request's rows, at most ``max_rows``, or an ``InvalidInput`` naming the
    first row and column that do not fit; ``batch(rows)``: rows of any requests as one batch."""

    columns: Sequence[str]

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows

    def rows(self, body: Any) -> list[R]:
        rows = body.get("rows") if isinstance(body, dict) else None
        if not isinstance(rows, list):
            raise InvalidInput('the body is a JSON object {"rows": [{column: value, ...}, ...]}')
        if not rows:
            raise InvalidInput("rows: empty; send one row at least")
        if len(rows) > self.max_rows:
            raise InvalidInput(f"rows: {len(rows)} rows, at most {self.max_rows} a request (--request-rows)")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise InvalidInput(f"rows[{i}]: expected an object of columns, got {_kind(row)}")
            missing = [c for c in self.columns if c not in row]
            if missing:
                raise InvalidInput(f"rows[{i}]: missing column {', '.join(missing)} (null is an empty field)")
        return [self._row(i, row) for i, row in enumerate(rows)]

    def _row(self, i: int, row: dict[str, Any]) -> R:
        raise NotImplementedError

    def batch(self, rows: list[R]) -> Batch:
        raise NotImplementedError


class SchemaRows(RowFormat[Row]):
    """Rows of a schema's columns, encoded as a trainer encodes its files' lines. A standardized
    column needs its mean and std in the schema (``rpcps export --data`` records the measured ones):
    a ``ConfigError`` says so otherwise."""

    def __init__(self, schema: Schema, max_rows: int) -> None:
        super().__init__(max_rows)
        self.schema = schema
        self.columns = [c for c in schema.used_columns if c != schema.label]
        try:
            self._encoder = Encoder(schema)
        except ValueError as exc:
            raise ConfigError(f"{exc}; the model needs it as training read it: export again with --data (the "
                              f"training files), or give it in the schema") from None

    def batch(self, rows: list[Row]) -> Batch:
        return self._encoder.batch(rows)

    def _row(self, i: int, row: dict[str, Any]) -> Row:
        numeric = [self._number(f"rows[{i}].{n.column}", row[n.column], n) for n in self.schema.numeric]
        categorical = [self._field(f"rows[{i}].{c.column}", row[c.column], c) for c in self.schema.categorical]
        return Row(0.0, numeric, categorical)

    @staticmethod
    def _number(where: str, value: Any, n: Numeric) -> Optional[float]:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"{where}: expected a number or null, got {_kind(value)} {_shown(value)}")
        try:
            number = float(value)
        except OverflowError:       # an integer of hundreds of digits
            number = math.inf
        if not abs(number) <= FLOAT32_MAX:
            raise InvalidInput(f"{where}: expected a number within float32's range (±{FLOAT32_MAX:.4g}), the model's, "
                               f"got {_shown(value)}")
        value = number
        if n.log1p and clipped(value, n.clip) <= -1:
            raise InvalidInput(f"{where}: the column takes log1p, which needs a value above -1, got {value:g}")
        return value

    @staticmethod
    def _value(where: str, value: Any) -> str:
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:      # JSON's "\ud800": a lone surrogate is no text
                    raise InvalidInput(f"{where}: not text (it holds a lone UTF-16 surrogate): {_shown(value)}") \
                        from None
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise InvalidInput(f"{where}: expected a string or an integer, got {_kind(value)} {_shown(value)}")

    def _field(self, where: str, value: Any, c: Categorical) -> str:
        """The field's text as a data file would hold it."""
        if value is None:
            return ""
        if c.separator is None:
            if isinstance(value, list):
                raise InvalidInput(f"{where}: one value (the column is not a list), got a list")
            return self._value(where, value)
        if isinstance(value, list):
            items = [self._value(f"{where}[{k}]", v) for k, v in enumerate(value)]
            for k, item in enumerate(items):
                if c.separator in item:
                    raise InvalidInput(f"{where}[{k}]: holds the separator {c.separator!r}, which splits the "
                                       f"column's values")
            text = c.separator.join(items)
        else:
            text = self._value(where, value)
        count = len(values_of(text, c.separator))
        if count > c.max_length:
            raise InvalidInput(f"{where}: {count} values, at most {c.max_length} (the column's max_length)")
        return text


class CriteoRows(RowFormat[Parsed]):
    """Rows of a Criteo line's columns, read as the built-in DLRM's trainers read Criteo files:
    ``cardinalities`` are its tables' rows (0 for a table keyed by raw ids)."""

    def __init__(self, cardinalities: Sequence[int], max_rows: int) -> None:
        super().__init__(max_rows)
        self.cardinalities = list(cardinalities)
        self.columns = [f"I{j + 1}" for j in range(DENSE)] + [f"C{t + 1}" for t in range(CATEGORICAL)]

    def _row(self, i: int, row: dict[str, Any]) -> Parsed:
        fields = []
        for j, column in enumerate(self.columns):
            value = row[column]
            if value is None:
                fields.append("")
            elif j < DENSE and isinstance(value, int) and not isinstance(value, bool):
                fields.append(str(value))
            elif j >= DENSE and isinstance(value, str) and value.isascii() and "\t" not in value:
                fields.append(value)
            else:
                wanted = "an integer" if j < DENSE else "1 to 8 hexadecimal digits as a string"
                raise InvalidInput(f"rows[{i}].{column}: expected {wanted} or null, got {_kind(value)} {_shown(value)}")
        try:
            return parse("\t".join(["0", *fields]).encode(), f"rows[{i}]")
        except CriteoError as exc:
            raise InvalidInput(re.sub(r" \(field \d+\)", "", str(exc))) from None

    def batch(self, rows: list[Parsed]) -> Batch:
        return features(batch_of([r.label for r in rows], [r.counts for r in rows], [r.values for r in rows],
                                 self.cardinalities))
