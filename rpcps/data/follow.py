"""A followed folder (``rpcps up --data DIR --follow``): its files trained on in name order as they
land, each once, so the model served a moment later has seen them.

- **Landing**: a file counts once it is in the folder under its final name; write it elsewhere (or
  as a hidden ``.name``) and rename it into place, as ``rpcps data ratings`` does, so no trainer
  reads half a file. Names must sort in landing order (a timestamp or a sequence number first): a
  file that lands with a name before one already read is left unread, and said so in the log.
- **Shares**: trainer ``k`` of ``n`` takes each file's records ``k``, ``k + n``, … (Parquet too:
  a landed file is small enough for every trainer to decode). Each trainer cuts its share of a
  file into the same number of batches, about ``batch_size`` records each, so that in sync mode
  the trainers reach a file's end at the same step and wait for the next together.
- **Position**: the file being read and its records passed (every share's). It is in every
  checkpoint, and a trainer waiting for the next file tells it to the leader, so a trainer lost
  there resumes with no record trained twice and none skipped.
- **Held out**: the named files of ``--eval-data``; or, with ``held`` > 0, each file's first
  ``held`` share of records is never trained on, and evaluation reads those of the newest files:
  a rolling window over what landed last.
- **Behind**: ``behind()`` says how far training is behind the newest file, in records and in
  seconds since the oldest file not yet read through landed.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from rpcps.data.files import data_files
from rpcps.data.source import OpenStream, Stream

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1          # how often a waiting trainer looks at the folder
BEHIND_EVERY = 1.0          # seconds between two counts of what is left to read


@dataclass
class FollowSource:
    """Trainer ``share`` of ``shares`` over the files landing in ``folder``. ``files(paths)`` opens
    a format's stream over some files (``OpenStream``: share, shares, start, stop); ``count(path)``
    is a file's records; ``held``: each file's share held out (0: none; ``evaluated``: files held
    out of their own instead)."""

    folder: Path
    files: Callable[[Sequence[Path]], OpenStream]
    count: Callable[[Path], int]
    batch_size: int
    share: int = 0
    shares: int = 1
    held: float = 0.0
    evaluated: Optional[OpenStream] = None
    evaluated_what: str = ""
    file: Optional[str] = None       # the file being read, or read last
    record: int = 0                  # its records passed, every share's
    skipped: int = 0
    last_skip: Optional[str] = None
    _stream: Optional[Stream] = field(default=None, init=False, repr=False)
    _batches: Optional[Iterator[Any]] = field(default=None, init=False, repr=False)
    _pending: Optional[tuple[Any, int]] = field(default=None, init=False, repr=False)   # (batch, record after it)
    _records: dict[str, int] = field(default_factory=dict, init=False, repr=False)       # counted files
    _truncated: int = field(default=0, init=False, repr=False)
    _behind: tuple[float, tuple[int, float]] = field(default=(-math.inf, (0, 0.0)), init=False, repr=False)
    _seen: Optional[set[str]] = field(default=None, init=False, repr=False)   # names listed so far
    _unordered: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def description(self) -> str:
        held = (f"held out: {self.evaluated_what}" if self.evaluated is not None
                else f"each file's first {self.held:.0%} held out" if self.held else "none held out")
        return f"files landing in {self.folder} ({held})"

    @property
    def truncated(self) -> int:
        """Lists cut so far: every file's stream shares one encoder, whose count goes on across files."""
        return getattr(self._stream, "truncated", self._truncated)

    # --- the Source protocol -------------------------------------------------------------------------
    def ready(self, wait: float = 0.0) -> bool:
        """Whether ``next`` has a batch now; if not, looks for one for up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while self._pending is None:
            if not self._advance():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        return True

    def next(self) -> Any:
        if not self.ready():
            raise LookupError(f"{self.description}: no file has landed past {self.file or 'the start'} yet")
        batch, self.record = self._pending
        self._pending = None
        return batch

    def held_out(self, count: int, batch_size: int) -> Iterator[Any]:
        if self.evaluated is not None:
            return self.evaluated(0, 1, 0, count).batches(batch_size)
        return self._window(count, batch_size)

    def state(self) -> dict[str, Any]:
        return {"file": self.file, "record": self.record}

    def restore(self, states: list[dict[str, Any]], mine: Optional[dict[str, Any]]) -> str:
        if mine is not None:
            self.file, self.record = mine.get("file"), int(mine.get("record", 0))
        else:
            # Divided anew: from the earliest place any trainer was, so no record is lost (those
            # after it that some trainer had passed are trained again).
            self.file, self.record = min(((s.get("file"), int(s.get("record", 0))) for s in states),
                                         key=lambda p: (p[0] is not None, p[0] or "", p[1]))
        self._close()
        return f"record {self.record} of {self.file}" if self.file else "the folder's first file"

    # --- how far behind ---------------------------------------------------------------------------
    def behind(self) -> tuple[int, float]:
        """(records landed that this trainer has not passed, every share's; seconds since the
        oldest file not read through landed), counted at most every ``BEHIND_EVERY`` seconds."""
        counted_at, found = self._behind
        if time.monotonic() - counted_at < BEHIND_EVERY:
            return found
        records, since = 0, None
        for path in self._landed():
            if path.name < (self.file or "") or path.name in self._unordered:
                continue
            left = self._count(path) - (self.record if path.name == self.file else 0)
            if left > 0:
                records += left
                since = since if since is not None else _landed_at(path)
        found = (records, max(0.0, time.time() - since) if since is not None else 0.0)
        self._behind = (time.monotonic(), found)
        return found

    # --- reading ------------------------------------------------------------------------------------
    def _advance(self) -> bool:
        """A batch pending, from the open file or the next one landed; False if none has landed."""
        while True:
            if self._batches is not None:
                before = self._stream.skipped
                batch = next(self._batches, None)
                self.skipped += self._stream.skipped - before
                self.last_skip = self._stream.last_skip or self.last_skip
                if batch is not None:
                    self._pending = (batch, self._stream.lines)
                    return True
                self._pending_end()
            path = self._next_file()
            if path is None:
                return False
            self._open(path)

    def _pending_end(self) -> None:
        """The open file read through: its end is the position (when ``next`` gives no more of it)."""
        assert self._stream is not None
        self._truncated = getattr(self._stream, "truncated", self._truncated)
        end = self._count(self._path(self.file))
        self._close()
        self.record = max(self.record, end)

    def _open(self, path: Path) -> None:
        records = self._count(path)
        held = math.ceil(self.held * records) if self.evaluated is None else 0
        start = max(held, self.record if path.name == self.file else 0)
        self.file, self.record = path.name, start
        size = self.batch_size_for(records - held)
        self._stream = self.files([path])(self.share, self.shares, start, None)
        self._batches = self._stream.batches(size)
        log.info("reading %s from record %d of %d, %d a batch", path, start, records, size)

    def batch_size_for(self, records: int) -> int:
        """The batch size every share of a file's ``records`` takes, about ``batch_size``, such that
        all shares (``records // shares`` or one more records each) come to the same number of
        batches: in sync mode the trainers then finish a file at the same step and wait for the
        next together. Fixed for the whole file, so a trainer resumed in its middle keeps it."""
        size, least = self.batch_size, records // self.shares
        while records % self.shares and least % size == 0 and least:
            size += 1          # a share of one more record would take one more batch
        return size

    def _close(self) -> None:
        self._stream = self._batches = None
        self._pending = None

    def _next_file(self) -> Optional[Path]:
        """The first landed file not read through: the current one if it is not, else the next by name."""
        for path in self._landed():
            if self.file is None or path.name > self.file:
                return path
            if path.name == self.file and self.record < self._count(path):
                return path
        return None

    def _landed(self) -> list[Path]:
        paths = data_files(self.folder)
        if self._seen is None:          # what was there at the start, or read before a restart
            self._seen = {p.name for p in paths}
        for path in paths:
            if path.name in self._seen:
                continue
            self._seen.add(path.name)
            if self.file is not None and path.name < self.file:
                self._unordered.add(path.name)
                log.warning("%s landed after %s was read, but its name sorts before it: it is left unread (name "
                            "files so that they sort in the order they land)", path, self.file)
        return paths

    def _count(self, path: Path) -> int:
        if path.name not in self._records:
            try:
                self._records[path.name] = self.count(path)
            except OSError as exc:          # gone, or unreadable: its stream skips it, saying why
                log.warning("%s: cannot count its records: %s", path, exc.strerror or exc)
                return 0
        return self._records[path.name]

    def _path(self, name: Optional[str]) -> Path:
        return self.folder / (name or "")

    def _window(self, count: int, batch_size: int) -> Iterator[Any]:
        """The held-out records of the newest files, newest first, ``count`` in all."""
        left = count
        for path in reversed(self._landed()):
            if left <= 0:
                return
            held = math.ceil(self.held * self._count(path))
            if not held:
                continue
            stream = self.files([path])(0, 1, 0, min(held, left))
            for batch in stream.batches(batch_size):
                left -= len(batch)
                yield batch


def _landed_at(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()
