"""Formats of data files, by the name a schema gives as its ``format`` (the built-in DLRM's Criteo
files: ``criteo``): how each checks its files' first records before anything starts, and reads a
share of them as ``Row``s a schema's ``Encoder`` turns into batches."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from rpcps.data.source import Stream
    from rpcps.data.encoding import Row
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
    ones skipped and counted (and logged, when ``logged``); ``stream(encoder, paths, share,
    shares, start, stop)``: the same records as batches (``rpcps.data.source.Stream``), as a
    trainer reads them; ``count(schema, paths, limit)``: the files' records, counted no further
    than ``limit``. Share ``k`` of ``n`` is records ``k``, ``k + n``, … in every format."""

    check: Callable[["Optional[Schema]", Sequence[Path], int], None]
    count: Callable[["Optional[Schema]", Sequence[Path], int], int]
    rows: Optional[Callable[..., RowStream]] = None         # none: Criteo's, read by its own stream
    stream: Optional[Callable[..., "Stream"]] = None


def _text() -> Format:
    from rpcps.data import text
    from rpcps.data.lines import count_lines
    return Format(text.text_check, lambda schema, paths, limit: count_lines(paths, limit, schema.header),
                  text.text_rows,
                  lambda encoder, paths, share=0, shares=1, start=0, stop=None:
                  text.SchemaStream(encoder, paths, share, shares, start, stop))


def _criteo() -> Format:
    from rpcps.data import criteo
    from rpcps.data.lines import count_lines
    return Format(lambda schema, paths, records: criteo.check(paths, records),
                  lambda schema, paths, limit: count_lines(paths, limit))


def _parquet() -> Format:
    from rpcps.data import parquet
    return Format(parquet.check, parquet.count,
                  lambda schema, paths, share, shares, start, stop, logged:
                  parquet.ParquetRows(schema, paths, share, shares, start, stop, logged=logged),
                  lambda encoder, paths, share=0, shares=1, start=0, stop=None:
                  parquet.ParquetStream(encoder.schema, paths, share, shares, start, stop, encoder=encoder))


# Loaded on first use: a format's reader (pyarrow's, say) is imported only where its files are read.
FORMATS: dict[str, Callable[[], Format]] = {"csv": _text, "tsv": _text, "parquet": _parquet, "criteo": _criteo}


def reader_of(schema: "Optional[Schema]") -> Format:
    """The format ``schema`` reads its files in (none: Criteo's, the built-in DLRM's)."""
    return FORMATS["criteo" if schema is None else schema.format]()
