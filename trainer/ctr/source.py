"""Where a CTR trainer's batches come from, and where it is in them: generated samples (a share of
an endless stream of sample indices) or Criteo files (a share of their lines, read again from the
top at their end). Either way the held-out samples are never trained on, and a position is one
number a checkpoint saves: the samples (or lines) of the whole stream passed so far."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Sequence

import numpy as np

from services.errors import ConfigError
from trainer.ctr.builtin import Scored, features
from trainer.ctr.config import data_files
from trainer.ctr.criteo import CriteoStream, table_sizes
from trainer.ctr.synthetic import Batch, SyntheticCtr, raw_ids

if TYPE_CHECKING:
    from rpcps.schema import Schema

log = logging.getLogger(__name__)


@dataclass
class GeneratedSource:
    """Trainer ``share`` of ``shares`` takes indices ``cursor + share``, ``+ shares``, … of the
    generator's stream: each step's batch of every trainer together is one range of the stream."""

    generator: SyntheticCtr
    batch_size: int
    share: int = 0
    shares: int = 1
    hot: int = 1
    cursor: int = 0          # the stream's samples passed (every trainer's share of them)
    skipped: int = 0         # nothing is ever malformed here
    truncated: int = 0       # nor too long
    hashed: tuple[int, ...] = ()     # tables whose ids are given raw (64-bit), for hashed tables

    @property
    def description(self) -> str:
        g = self.generator
        return f"generated Criteo-shaped data (seed {g.seed}, scale {g.scale:g}" + \
            (f", {self.hot} ids per feature)" if self.hot > 1 else ")")

    def next(self) -> Scored:
        return features(self.samples())

    def samples(self) -> Batch:
        """The next batch as generated (``next``: as the model takes it); the position moves past it."""
        indices = self.generator.share(self.cursor, self.batch_size * self.shares, self.share, self.shares)
        self.cursor += self.batch_size * self.shares
        return self._batch(indices)

    def held_out(self, count: int, batch_size: int) -> Iterator[Scored]:
        indices = self.generator.held_out(count)
        for start in range(0, count, batch_size):
            yield features(self._batch(indices[start:start + batch_size]))

    def _batch(self, indices: np.ndarray) -> Batch:
        batch = self.generator.batch(indices, self.hot)
        return replace(batch, ids=raw_ids(batch.ids, self.hashed)) if self.hashed else batch


class Stream(Protocol):
    """One pass over one share of data files: ``CriteoStream``, or ``SchemaStream`` for a schema's."""

    skipped: int
    last_skip: Optional[str]
    lines: int           # data lines of the files passed so far, every share's

    def batches(self, size: int) -> Iterator[Any]: ...


# (share, shares, start, stop) -> the stream of that share from data line start to stop
OpenStream = Callable[[int, int, int, Optional[int]], Stream]


class CriteoFeatures(CriteoStream):
    """Criteo files' batches as the model takes them."""

    def batches(self, size: int) -> Iterator[Scored]:
        return map(features, super().batches(size))


def criteo_files(paths: Sequence[Path], cardinalities: Sequence[int]) -> OpenStream:
    return lambda share, shares, start, stop: CriteoFeatures(paths, cardinalities, share, shares, start, stop)


@dataclass
class FileSource:
    """Trainer ``share`` of ``shares`` takes lines ``k`` with ``k % shares == share`` of the
    files after the first ``held`` (the held-out lines), or of all of them when ``evaluated``
    opens held-out files of their own (``--eval-data``); ``cursor``: the lines passed, every
    share's, in this pass (``epoch``) over the files. ``what``: the files, in words."""

    what: str
    open: OpenStream
    batch_size: int
    held: int = 0
    share: int = 0
    shares: int = 1
    cursor: int = 0
    epoch: int = 0
    skipped: int = 0
    last_skip: Optional[str] = None
    evaluated: Optional[OpenStream] = None
    evaluated_what: str = ""
    _stream: Optional[Stream] = field(default=None, init=False, repr=False)
    _batches: Optional[Iterator[Any]] = field(default=None, init=False, repr=False)

    @property
    def description(self) -> str:
        held = (f"held out: {self.evaluated_what}" if self.evaluated is not None
                else f"the first {self.held} lines held out")
        return f"{self.what} ({held})"

    @property
    def truncated(self) -> int:
        """Lists longer than their schema's ``max_length``, cut (a schema's files only)."""
        return getattr(self._stream, "truncated", 0)

    def _open(self) -> None:
        self._stream = self.open(self.share, self.shares, max(self.cursor, self.held), None)
        self._batches = self._stream.batches(self.batch_size)

    def next(self) -> Any:
        for _ in range(2):      # at the files' end, once more from their top
            if self._batches is None:
                self._open()
            before = self._stream.skipped
            batch = next(self._batches, None)
            self.skipped += self._stream.skipped - before
            self.last_skip = self._stream.last_skip or self.last_skip
            if batch is not None:
                self.cursor = self._stream.lines
                return batch
            self.epoch += 1
            self.cursor, self._batches = 0, None
            log.info("the data files read through: pass %d over them begins", self.epoch + 1)
        raise ValueError(f"{self.description}: no training lines for share {self.share} of {self.shares}")

    def held_out(self, count: int, batch_size: int) -> Iterator[Any]:
        if self.evaluated is not None:
            return self.evaluated(0, 1, 0, count).batches(batch_size)
        return self.open(0, 1, 0, min(count, self.held)).batches(batch_size)


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
            raise ConfigError(f"the servers' {exc}: generated data cannot fill them; use --data") from None
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
    from trainer.ctr.tabular import Encoder, SchemaStream, measure
    paths = data_files(data)
    stats = measure(schema, paths)
    for column, (mean, std) in stats.items():
        log.info("column %s standardized by the mean %.6g and std %.6g of the data's first lines", column, mean, std)
    try:
        encoder = Encoder(schema, stats)
    except ValueError as exc:
        raise ConfigError(f"--schema: {exc}") from None

    def files(read: Sequence[Path]) -> OpenStream:
        return lambda s, n, start, stop: SchemaStream(encoder, read, s, n, start, stop)
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
