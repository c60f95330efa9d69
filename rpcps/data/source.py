"""What a trainer's batches come from: the ``Source`` protocol every reader meets, and ``FileSource``,
the one over data files of any format.

A source owns where it is: ``state()`` is what a checkpoint saves of it (opaque to everything but
the source), and ``restore`` goes on from saved states, this trainer's own or, when the trainers
were re-divided, every one of them. A new kind of input (a message queue, say) is one class with
these members (``BaseSource`` gives the optional ones their defaults), named to ``rpcps up`` as
``--source module:Class`` (``load_source``); the docs' guide to data shows one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol

from rpcps.batch import Batch

if TYPE_CHECKING:
    from rpcps.schema import Schema

log = logging.getLogger(__name__)


class Source(Protocol):
    """One trainer's batches: its share of the data, in order, and the held-out batches. Besides
    the methods below, a source has four attributes: ``description`` (what it reads, in words: a
    checkpoint's positions are used only by a source that says the same), ``skipped`` and
    ``last_skip`` (records it could not read, skipped and counted, and why the last one was),
    and ``truncated`` (lists cut to their ``max_length``)."""

    description: str         # what it reads, in words: saved positions are used only by a source that says the same
    skipped: int             # records it could not read, skipped and counted
    last_skip: Optional[str]  # why the last one was skipped
    truncated: int           # lists cut to their max_length

    def ready(self, wait: float) -> bool:
        """Whether ``next`` has a batch now, looking for one up to ``wait`` seconds (a source whose
        data lands while it trains may have none yet; the trainer waits at a step boundary)."""

    def next(self) -> Batch:
        """The next training batch; the position moves past it."""

    def held_out(self, count: int, batch_size: int) -> Iterator[Batch]:
        """``count`` held-out samples (never trained on), ``batch_size`` at a time."""

    def state(self) -> dict[str, Any]:
        """Where it is, as JSON a checkpoint saves: ``restore`` takes it back. Asked after every
        batch, whose update carries it to the servers (a replacement resumes after the last batch
        they applied): keep it a few numbers."""

    def restore(self, states: list[dict[str, Any]], mine: Optional[dict[str, Any]]) -> str:
        """Go on from ``mine`` (this trainer's saved state, the trainers the same), or else from
        ``states`` (every trainer's, saved when they were divided otherwise); in words, how."""

    def behind(self) -> Optional[tuple[int, float]]:
        """How far training is behind the data that has landed: (records, seconds), or None for
        data that does not land (files read over and over, generated samples)."""


class BaseSource:
    """A ``Source`` whose optional members have their defaults: subclass it and write ``next``,
    ``held_out``, ``state`` and ``restore``. ``schema``, ``share``, ``shares`` and ``batch_size``
    are what ``--source module:Class`` builds it with; ``description`` is the class's name unless
    you say what it reads (a checkpoint's positions are used only by a source that says the same).
    It always has a batch (``ready``), never lags behind data that lands (``behind``), and has
    skipped and cut nothing until you count it."""

    skipped: int = 0
    last_skip: Optional[str] = None
    truncated: int = 0

    def __init__(self, schema: "Schema", share: int = 0, shares: int = 1, batch_size: int = 1024) -> None:
        self.schema, self.share, self.shares, self.batch_size = schema, share, shares, batch_size
        self.description: str = type(self).__name__

    def ready(self, wait: float) -> bool:
        return True

    def behind(self) -> Optional[tuple[int, float]]:
        return None

    def next(self) -> Batch:
        raise NotImplementedError(f"{type(self).__name__}.next: the next training batch")

    def held_out(self, count: int, batch_size: int) -> Iterator[Batch]:
        raise NotImplementedError(f"{type(self).__name__}.held_out: the held-out batches")

    def state(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__}.state: where it is, as JSON")

    def restore(self, states: list[dict[str, Any]], mine: Optional[dict[str, Any]]) -> str:
        raise NotImplementedError(f"{type(self).__name__}.restore: go on from a saved state")


def redivided(states: list[dict[str, Any]]) -> tuple[int, int]:
    """(cursor, epoch) where trainers divided anew go on from: the furthest pass's mean cursor.
    Every trainer of a pass reads its own share of the same records, so their mean is where the
    pass stands as a whole."""
    epoch = max(int(s.get("epoch", 0)) for s in states)
    furthest = [int(s.get("cursor", 0)) for s in states if int(s.get("epoch", 0)) == epoch]
    return sum(furthest) // len(furthest), epoch


MEMBERS = ("description", "skipped", "last_skip", "truncated", "ready", "next", "held_out", "state", "restore",
           "behind")


def load_source(ref: str, schema: "Schema", share: int, shares: int, batch_size: int) -> Source:
    """A source of your own (``--source module:Class``), built in each trainer as
    ``Class(schema, share, shares, batch_size)``: trainer ``share`` of ``shares``, ``batch_size``
    records a batch. A ``ModelError`` says what is wrong with it."""
    from rpcps.model import ModelError, imported, said
    cls = imported(ref, "--source")
    try:
        source = cls(schema, share, shares, batch_size)
    except Exception as exc:    # noqa: BLE001 - the user's constructor
        raise ModelError(f"--source {ref}: {ref.partition(':')[2]}(schema, share, shares, batch_size) raised "
                         f"{said(exc)}") from None
    missing = [m for m in MEMBERS if not hasattr(source, m)]
    if missing:
        raise ModelError(f"--source {ref}: a source has {', '.join(MEMBERS)} (rpcps.data.Source); "
                         f"{type(source).__name__} lacks {', '.join(missing)}")
    return source


class Stream(Protocol):
    """One pass over one share of data files, in one format (``rpcps/data/formats.py``)."""

    skipped: int
    last_skip: Optional[str]
    lines: int           # records of the files passed so far, every share's

    def batches(self, size: int) -> Iterator[Any]: ...


# (share, shares, start, stop) -> the stream of that share from record start to stop
OpenStream = Callable[[int, int, int, Optional[int]], Stream]


@dataclass
class FileSource:
    """Trainer ``share`` of ``shares`` takes its share of the records of the files after the
    first ``held`` (the held-out ones), or of all of them when ``evaluated`` opens held-out files
    of their own (``--eval-data``); ``cursor``: the records passed, every share's, in this pass
    (``epoch``) over the files, which start again from the top at their end. ``what``: the files,
    in words."""

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
                else f"the first {self.held} records held out")
        return f"{self.what} ({held})"

    @property
    def truncated(self) -> int:
        """Lists longer than their schema's ``max_length``, cut (a schema's files only)."""
        return getattr(self._stream, "truncated", 0)

    def ready(self, wait: float = 0.0) -> bool:
        return True

    def behind(self) -> Optional[tuple[int, float]]:
        return None

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "epoch": self.epoch}

    def restore(self, states: list[dict[str, Any]], mine: Optional[dict[str, Any]]) -> str:
        if mine is not None:
            self.cursor, self.epoch = int(mine.get("cursor", 0)), int(mine.get("epoch", 0))
        else:
            self.cursor, self.epoch = redivided(states)
        self._stream = self._batches = None
        return f"record {self.cursor} of pass {self.epoch + 1} over the files"

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
        raise ValueError(f"{self.description}: no record to train on for trainer {self.share} of {self.shares}")

    def held_out(self, count: int, batch_size: int) -> Iterator[Any]:
        if self.evaluated is not None:
            return self.evaluated(0, 1, 0, count).batches(batch_size)
        return self.open(0, 1, 0, min(count, self.held)).batches(batch_size)
