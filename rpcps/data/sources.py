"""The built-in readers, chosen by what the trainers read: generated samples (``GeneratedSource``),
Criteo files for the built-in DLRM, or a schema's files in the schema's ``format``; each a
``Source`` (``rpcps/data/source.py``) whose held-out samples are never trained on."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from rpcps.data.criteo import CriteoStream, table_sizes
from rpcps.data.files import data_files
from rpcps.data.formats import reader_of
from rpcps.data.generated import GeneratedSource, Scored, SyntheticCtr, features
from rpcps.data.source import FileSource, OpenStream

if TYPE_CHECKING:
    from rpcps.schema import Schema

log = logging.getLogger(__name__)


class CriteoFeatures(CriteoStream):
    """Criteo files' batches as the model takes them."""

    def batches(self, size: int) -> Iterator[Scored]:
        return map(features, super().batches(size))


def criteo_files(paths: Sequence[Path], cardinalities: Sequence[int]) -> OpenStream:
    return lambda share, shares, start, stop: CriteoFeatures(paths, cardinalities, share, shares, start, stop)


def criteo_source(data: Optional[Path], cardinalities: Sequence[int], hashed: Sequence[int], batch_size: int,
                  held: int, share: int = 0, shares: int = 1, hot: int = 1, data_seed: int = 1,
                  eval_data: Optional[Path] = None) -> "GeneratedSource | FileSource":
    """The built-in DLRM's data (``trainer/ctr/builtin.py``): generated (no ``data``) or Criteo
    files, as the schema's features; the tables in ``hashed`` take raw 64-bit ids. ``held``
    lines of ``data`` are held out, or none when ``eval_data`` are files held out of their own."""
    if data is None:
        try:
            generator = SyntheticCtr.fitting(cardinalities, data_seed)
        except ValueError as exc:
            raise ValueError(f"the servers' {exc}: generated data cannot fill them; use --data") from None
        return GeneratedSource(generator, batch_size, share, shares, hot, hashed=tuple(hashed))
    paths = data_files(data)
    sizes = table_sizes(cardinalities, hashed)     # a hashed table: the raw 64-bit hash
    source = FileSource(f"Criteo files {', '.join(map(str, paths))}", criteo_files(paths, sizes), batch_size, held,
                        share, shares)
    return _held_apart(source, eval_data, lambda p: criteo_files(p, sizes))


def schema_source(schema: "Schema", data: Path, batch_size: int, held: int, share: int = 0, shares: int = 1,
                  eval_data: Optional[Path] = None) -> FileSource:
    """A schema's files; its standardized columns without statistics measured on their first lines.
    ``held`` lines of ``data`` are held out, or none when ``eval_data`` are files of their own."""
    from rpcps.data.tabular import Encoder, measure
    paths = data_files(data)
    stats = measure(schema, paths)
    for column, (mean, std) in stats.items():
        log.info("column %s standardized by the mean %.6g and std %.6g of the data's first lines", column, mean, std)
    try:
        encoder = Encoder(schema, stats)
    except ValueError as exc:
        raise ValueError(f"--schema: {exc}") from None

    stream = reader_of(schema).stream

    def files(read: Sequence[Path]) -> OpenStream:
        return lambda s, n, start, stop: stream(encoder, read, s, n, start, stop)
    source = FileSource(f"{schema.format.upper()} files {', '.join(map(str, paths))}", files(paths), batch_size,
                        held, share, shares)
    return _held_apart(source, eval_data, files)


def _held_apart(source: FileSource, eval_data: Optional[Path], files: Callable[[Sequence[Path]], OpenStream]
                ) -> FileSource:
    """``source`` evaluated on the files ``eval_data`` names, when it names any: then every line
    of its own files is trained on."""
    if eval_data is None:
        return source
    paths = data_files(eval_data)
    source.held, source.evaluated, source.evaluated_what = 0, files(paths), ", ".join(map(str, paths))
    return source
