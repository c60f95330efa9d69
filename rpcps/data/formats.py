"""Formats of data files, by the name a schema gives as its ``format`` (the built-in DLRM's Criteo
files: ``criteo``): how each checks its files' first records before anything starts, and reads a
share of them as ``Row``s a schema's ``Encoder`` turns into batches."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from rpcps.data.tabular import Row
    from rpcps.schema import Schema


class RowStream(Iterable["Row"]):
    """One share's records of some files, as rows: what ``Format.rows`` gives."""

    skipped: int
    last_skip: Optional[str]
    reasons: list[str]
    lines: int           # records of the files passed so far, every share's


@dataclass(frozen=True)
class Format:
    """``check(schema, paths, records)``: a ``LineError`` naming the first record of the first
    ``records`` of each file that is not in this format; ``rows(schema, paths, share, shares,
    start, stop, logged)``: one share's rows, from record ``start`` to ``stop``, the unreadable
    ones skipped and counted (and logged, when ``logged``)."""

    check: Callable[["Optional[Schema]", Sequence[Path], int], None]
    rows: Optional[Callable[..., RowStream]] = None      # none: Criteo's, read by its own stream


def _text() -> Format:
    from rpcps.data import tabular
    return Format(tabular.text_check, tabular.text_rows)


def _criteo() -> Format:
    from rpcps.data import criteo
    return Format(lambda schema, paths, records: criteo.check(paths, records))


def _parquet() -> Format:
    from rpcps.data import parquet
    return Format(parquet.check, parquet.ParquetRows)


# Loaded on first use: a format's reader (pyarrow's, say) is imported only where its files are read.
FORMATS: dict[str, Callable[[], Format]] = {"csv": _text, "tsv": _text, "parquet": _parquet, "criteo": _criteo}


def reader_of(schema: "Optional[Schema]") -> Format:
    """The format ``schema`` reads its files in (none: Criteo's, the built-in DLRM's)."""
    return FORMATS["criteo" if schema is None else schema.format]()
