"""The built-in readers, chosen by what the trainers read: generated samples (``GeneratedSource``),
Criteo files for the built-in DLRM, or a schema's files in the schema's ``format``; each a
``Source`` (``rpcps/data/source.py``) whose held-out samples are never trained on."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from rpcps.data.criteo import CriteoStream, table_sizes
from rpcps.data.files import data_files
from rpcps.data.follow import FollowSource
from rpcps.data.formats import reader_of
from rpcps.data.generated import GeneratedSource, Scored, SyntheticCtr, features
from rpcps.data.lines import count_lines
from rpcps.data.source import FileSource, OpenStream, Source

if TYPE_CHECKING:
    from rpcps.schema import Schema

log = logging.getLogger(__name__)


class CriteoFeatures(CriteoStream):
    """Criteo files' batches as the model takes them."""

    def batches(self, size: int) -> Iterator[Scored]:
        return map(features, super().batches(size))


def criteo_files(paths: Sequence[Path], cardinalities: Sequence[int]) -> OpenStream:
    return lambda share, shares, start, stop: CriteoFeatures(paths, cardinalities, share, shares, start, stop)


# (the files read) -> their stream's opener
Files = Callable[[Sequence[Path]], OpenStream]


@dataclass(frozen=True)
class Follow:
    """``--follow``: files landing in the folder, trained on as they land (``FollowSource``);
    ``held``: each file's share held out (without ``--eval-data``)."""

    held: float = 0.0


def criteo_source(data: Optional[Path], cardinalities: Sequence[int], hashed: Sequence[int], batch_size: int,
                  held: int, share: int = 0, shares: int = 1, hot: int = 1, data_seed: int = 1,
                  eval_data: Optional[Path] = None, follow: Optional[Follow] = None) -> Source:
    """The built-in DLRM's data (``trainer/ctr/builtin.py``): generated (no ``data``) or Criteo
    files, as the schema's features; the tables in ``hashed`` take raw 64-bit ids. ``held``
    lines of ``data`` are held out, or none when ``eval_data`` are files held out of their own."""
    if data is None:
        try:
            generator = SyntheticCtr.fitting(cardinalities, data_seed)
        except ValueError as exc:
            raise ValueError(f"the servers' {exc}: generated data cannot fill them; use --data") from None
        return GeneratedSource(generator, batch_size, share, shares, hot, hashed=tuple(hashed))
    sizes = table_sizes(cardinalities, hashed)     # a hashed table: the raw 64-bit hash
    return _opened(data, "Criteo", lambda read: criteo_files(read, sizes),
                   lambda path: count_lines([path], _ALL), batch_size, held, share, shares, eval_data, follow)


def schema_source(schema: "Schema", data: Path, batch_size: int, held: int, share: int = 0, shares: int = 1,
                  eval_data: Optional[Path] = None, follow: Optional[Follow] = None) -> Source:
    """A schema's files; its standardized columns without statistics measured on their first lines.
    ``held`` lines of ``data`` are held out, or none when ``eval_data`` are files of their own."""
    from rpcps.data.encoding import Encoder
    from rpcps.data.statistics import measure
    stats = measure(schema, data_files(data))
    for column, (mean, std) in stats.items():
        log.info("column %s standardized by the mean %.6g and std %.6g of the data's first lines", column, mean, std)
    try:
        encoder = Encoder(schema, stats)
    except ValueError as exc:
        raise ValueError(f"--schema: {exc}") from None
    reader = reader_of(schema)

    def files(read: Sequence[Path]) -> OpenStream:
        return lambda s, n, start, stop: reader.stream(encoder, read, s, n, start, stop)
    return _opened(data, FORMAT_NAMES[schema.format], files, lambda path: reader.count(schema, [path], _ALL), batch_size,
                   held, share, shares, eval_data, follow)


_ALL = 1 << 62          # counted to the end
FORMAT_NAMES = {"csv": "CSV", "tsv": "TSV", "parquet": "Parquet"}      # as messages name a schema's format


def _opened(data: Path, what: str, files: Files, count: Callable[[Path], int], batch_size: int, held: int, share: int,
            shares: int, eval_data: Optional[Path], follow: Optional[Follow]) -> Source:
    """``data``'s files read once through and again (``FileSource``), or followed as they land
    (``FollowSource``); held out: ``held`` first records, or ``follow.held`` of each landing
    file, or none when ``eval_data`` names files of their own."""
    evaluated = (files(data_files(eval_data)), ", ".join(map(str, data_files(eval_data)))) \
        if eval_data is not None else (None, "")
    if follow is not None:
        return FollowSource(data, files, count, batch_size, share, shares,
                            0.0 if eval_data is not None else follow.held, *evaluated)
    paths = data_files(data)
    return FileSource(f"{what} files {', '.join(map(str, paths))}", files(paths), batch_size,
                      0 if eval_data is not None else held, share, shares, evaluated=evaluated[0],
                      evaluated_what=evaluated[1])
