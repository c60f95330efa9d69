"""A feature schema: what the columns of a user's CSV, TSV or Parquet files are, and how each
becomes a model's input. Written once as a YAML or TOML file and loaded with ``load_schema``::

    format: csv                 # or tsv, or parquet
    label: clicked              # 0 or 1 (any number in [0, 1])
    numeric:                    # in this order, the columns of Batch.dense
      - {column: price, log1p: true, standardize: true}
      - {column: age, fill: 30, clip: [0, 100]}
    categorical:                # each a feature of Batch.sparse, looked up in its table
      - {column: user_id, table: user}
      - {column: genres, table: genre, separator: "|", max_length: 5}
    tables:
      - {name: user, rows: 1000000, dim: 16, hashed: true}
      - {name: genre, rows: 100, dim: 16, pooling: mean}

A categorical value is hashed to 64 bits with its table's name (so equal values of two features
sharing a table are the same row; the user never label-encodes), then reduced modulo the table's
rows unless the table is hashed (keyed by the raw ids). An empty value, or an empty item of a
list, is no id: a sample's bag may be empty.

A numeric value is read as a float; an empty one takes ``fill``; then ``clip``, ``log1p`` and
``standardize`` apply, in that order. ``standardize`` with no ``mean`` and ``std`` uses measured ones:
``rpcps up`` measures them once on the training lines and gives every member the schema with them;
a role started alone measures its data's first lines (``rpcps data check`` prints them).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rpcps.tables import TableConfig

_STRICT = ConfigDict(extra="forbid", frozen=True)


class SchemaError(ValueError):
    """A schema that cannot be used; the message names the file, the key and what was expected."""


class Numeric(BaseModel):
    """A numeric column, fed to the model as one column of ``Batch.dense``."""

    model_config = _STRICT

    column: str = Field(description="the column's name; a list of names says the same of each (an entry each)",
                        json_schema_extra={"written": "text or list of text"})
    fill: float = Field(0.0, description="the value of an empty field")
    clip: Optional[tuple[Optional[float], Optional[float]]] = Field(
        None, description="[low, high]: values outside are moved to the nearer bound (null: no bound on that side)")
    log1p: bool = Field(False, description="take log(1 + value) (after clip; the value must be above -1)")
    standardize: bool = Field(False, description="subtract mean and divide by std (after log1p)")
    mean: Optional[float] = Field(None, description="standardize: the mean to subtract (none: measured on the "
                                                    "training lines)")
    std: Optional[float] = Field(None, gt=0, description="standardize: the deviation to divide by (none: measured)")

    @model_validator(mode="after")
    def _coherent(self) -> "Numeric":
        low, high = self.clip or (None, None)
        if low is not None and high is not None and not low <= high:
            raise ValueError(f"clip needs [low, high] with low <= high, got {list(self.clip)}")
        if not self.standardize and (self.mean is not None or self.std is not None):
            raise ValueError("mean and std are for standardize: true")
        if (self.mean is None) != (self.std is None):
            raise ValueError("standardize: give both mean and std, or neither (then they are measured)")
        if self.log1p and low is not None and low <= -1:
            raise ValueError(f"log1p needs values above -1, but clip lets {low} through")
        if not all(math.isfinite(v) for v in (self.fill, low or 0.0, high or 0.0, self.mean or 0.0, self.std or 1.0)):
            raise ValueError("fill, clip, mean and std must be finite numbers")
        return self


class Categorical(BaseModel):
    """A categorical column: one value per sample, or a list of them; a feature of
    ``Batch.sparse`` looked up in a table."""

    model_config = _STRICT

    column: str = Field(description="the column's name; a list of names says the same of each (an entry each)",
                        json_schema_extra={"written": "text or list of text"})
    feature: Optional[str] = Field(None, description="the feature's name in Batch.sparse (none: the column's)")
    table: Optional[str] = Field(None, description="the table it is looked up in (none: the one named as the "
                                                   "feature)")
    separator: Optional[str] = Field(None, min_length=1, description="a list of values (multi-hot), separated "
                                                                     "by this (a Parquet list column needs none)")
    max_length: int = Field(1, ge=1, description="a list's most values: longer ones are truncated and counted")

    @property
    def name(self) -> str:
        return self.feature or self.column

    @property
    def table_name(self) -> str:
        return self.table or self.name



class Schema(BaseModel):
    """The columns of the data files and the tables their categorical features use."""

    model_config = _STRICT

    format: Literal["csv", "tsv", "parquet"] = Field("csv", description="comma- or tab-separated values, or "
                                                                         "Parquet files (columns read by name)")
    header: bool = Field(True, description="each file's first line names its columns (CSV and TSV)")
    columns: Optional[tuple[str, ...]] = Field(None, description="the columns in order: required without a "
                                                                  "header; with one, every file's must match "
                                                                  "(CSV and TSV)")
    label: str = Field(description="the label's column: 0 or 1 (any number in [0, 1])")
    numeric: tuple[Numeric, ...] = Field((), description="numeric columns, in Batch.dense's order")
    categorical: tuple[Categorical, ...] = Field(description="categorical columns, one feature each")
    tables: tuple[TableConfig, ...] = Field(description="the tables the categorical features use")

    @model_validator(mode="before")
    @classmethod
    def _one_entry_a_column(cls, raw: Any) -> Any:
        """``column: [a, b, c]`` says the same of several columns: one entry each."""
        if not isinstance(raw, dict):
            return raw
        out = dict(raw)
        for key in ("numeric", "categorical"):
            entries = raw.get(key)
            if isinstance(entries, list):
                out[key] = [dict(e, column=c) if isinstance(e, dict) and isinstance(e.get("column"), list) else e
                            for e in entries for c in _columns(e)]
        return out

    @model_validator(mode="after")
    def _consistent(self) -> "Schema":
        if self.format == "parquet":
            text_only = [key for key, given in (("header", not self.header), ("columns", self.columns is not None))
                         if given]
            if text_only:
                raise ValueError(f"{' and '.join(text_only)}: Parquet files name their columns; leave "
                                 f"{'them' if len(text_only) > 1 else 'it'} out")
        else:
            lists = [c.column for c in self.categorical if c.separator is None and c.max_length != 1]
            if lists:
                raise ValueError(f"categorical: max_length is for a list of values: give column "
                                 f"{', '.join(lists)} its separator too")
        if not self.categorical:
            raise ValueError("categorical: a model on the parameter servers needs one categorical column at least")
        names = [c.name for c in self.categorical]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"categorical: feature {', '.join(twice)} is declared twice (give one a `feature:` "
                             f"name of its own)")
        declared = [t.name for t in self.tables]
        if len(set(declared)) != len(declared):
            raise ValueError(f"tables: a table is declared twice in {declared}")
        for t in self.tables:
            if t.features:
                raise ValueError(f"tables: table {t.name} lists features; say `table: {t.name}` on each "
                                 f"categorical column instead")
        for c in self.categorical:
            if c.table_name not in declared:
                raise ValueError(f"categorical: feature {c.name} uses table {c.table_name}, which `tables` does not "
                                 f"declare (it declares {', '.join(declared) or 'none'})")
        unused = [t for t in declared if t not in {c.table_name for c in self.categorical}]
        if unused:
            raise ValueError(f"tables: no categorical column uses table {', '.join(unused)}")
        if self.columns is not None:
            unknown = [c for c in self.used_columns if c not in self.columns]
            if unknown:
                raise ValueError(f"columns: {', '.join(unknown)} named but not among the columns "
                                 f"({', '.join(self.columns)})")
        elif not self.header and self.format != "parquet":
            raise ValueError("columns: files without a header need the columns' names in order")
        return self

    @property
    def used_columns(self) -> list[str]:
        return list(dict.fromkeys([self.label, *(n.column for n in self.numeric),
                                   *(c.column for c in self.categorical)]))

    @property
    def delimiter(self) -> str:
        return "\t" if self.format == "tsv" else ","

    @property
    def numeric_names(self) -> list[str]:
        """The columns of ``Batch.dense``, in order."""
        return [n.column for n in self.numeric]

    @property
    def features(self) -> list[str]:
        """The features of ``Batch.sparse``."""
        return [c.name for c in self.categorical]

    def table_configs(self) -> list[TableConfig]:
        """The tables, each with the features that use it: what ``EmbeddingBags`` is built from."""
        return [t.model_copy(update={"features": tuple(c.name for c in self.categorical if c.table_name == t.name)})
                for t in self.tables]


def _columns(entry: Any) -> list[Any]:
    many = isinstance(entry, dict) and isinstance(entry.get("column"), list)
    return entry["column"] if many else [None]


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic error's location as the file's keys read: ``categorical[2].table``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _read(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        import tomllib          # Python 3.11 on
        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml
        return yaml.safe_load(text)
    raise SchemaError(f"{path}: a schema is a .yaml, .yml or .toml file")


def load_schema(path: "str | Path") -> Schema:
    """The schema in ``path`` (YAML or TOML), or a ``SchemaError`` naming the file, the key and what
    was expected."""
    path = Path(path)
    try:
        raw = _read(path)
    except OSError as exc:
        raise SchemaError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SchemaError(f"{path}: not UTF-8 text") from None
    except Exception as exc:                        # the YAML or TOML parser's own, with its line
        if isinstance(exc, SchemaError):
            raise
        said = " ".join(str(exc).split())
        raise SchemaError(f"{path}: not valid {path.suffix.lstrip('.').upper()}: {said}") from None
    if not isinstance(raw, dict):
        raise SchemaError(f"{path}: a schema is a mapping of keys (format, label, numeric, categorical, tables)")
    try:
        return Schema.model_validate(raw)
    except ValidationError as exc:
        lines = [(f"{_where(e['loc'])}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
                 for e in exc.errors()]
        raise SchemaError(f"{path}: " + "; ".join(lines)) from None
