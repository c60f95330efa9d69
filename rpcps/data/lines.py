"""Data files read as lines, for any line format (Criteo's, a schema's CSV): plain text or gzip
(told by its first bytes), a line at a time, so a file of tens of gigabytes is never in memory.

Trainer ``k`` of ``n`` takes data lines ``k, k + n, k + 2n, …`` of the files in order: disjoint
shares that together are the whole data. A line the format cannot read is a ``LineError`` naming
the file and line: ``check_files`` raises the first in the first lines of every file before
anything starts; while training, ``Lines`` skips and counts it, and says why in its log (each of
the first skips, then at most one line every ``SKIP_LOG_SECONDS``).
"""
from __future__ import annotations

import gzip
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Generic, Iterator, Optional, Sequence, TypeVar

log = logging.getLogger(__name__)

MAX_LINE = 4096                # bytes a line may have
QUOTED = 40                    # characters of a value an error message quotes
CHECKED_LINES = 1000           # lines of each file read by ``check_files`` before anything starts
SKIP_LOG_SECONDS = 10.0        # after the first few, one log line at most this often about skipped lines
_LOGGED_SKIPS = 10             # skipped lines each logged on their own
REASONS = 20                   # skipped lines whose reasons a stream keeps
_BOM = b"\xef\xbb\xbf"

T = TypeVar("T")
# A format's reading of one line (or of the length of a line too long to read), at ``where``
# ("file:line"): what it holds, or a ``LineError``.
Parse = Callable[[bytes | int, str], T]


class LineError(ValueError):
    """A line or file a format cannot read; the message names the file and line."""


def open_lines(path: Path) -> IO[bytes]:
    """The file's lines as bytes: gunzipped when it starts with gzip's magic number; a UTF-8
    byte-order mark at its start skipped."""
    raw = open(path, "rb")
    f = gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == b"\x1f\x8b" else raw   # closing it leaves raw open: close both
    if f.peek(len(_BOM))[:len(_BOM)] == _BOM:
        f.read(len(_BOM))
    return f


def bounded_lines(f: IO[bytes], limit: int = MAX_LINE) -> Iterator[bytes | int]:
    """Each line of ``f``; for a line longer than ``limit`` bytes, its length instead: it is read
    past a piece at a time, never held whole."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        length = len(line)
        while not line.endswith(b"\n"):
            line = f.readline(1 << 16)
            if not line:
                break
            length += len(line)
        yield length - line.endswith(b"\n")


def text_of(line: bytes | int, where: str, error: type[LineError] = LineError) -> str:
    """A line as text, without its end, or ``error``: too long, or not UTF-8."""
    if isinstance(line, int):
        raise error(f"{where}: the line is {line:,} bytes long; a line may have at most {MAX_LINE:,}")
    try:
        return line.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})") from None


def quoted(value: str, limit: int = QUOTED) -> str:
    """``value`` as an error message quotes it: at most ``limit`` characters, and its length if longer."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value):,} characters)"


def why(exc: BaseException) -> str:
    """Why a file cannot be read, in words."""
    if isinstance(exc, EOFError):
        return "the gzip stream is truncated"
    if isinstance(exc, gzip.BadGzipFile):
        return f"not a valid gzip file ({exc})"
    return getattr(exc, "strerror", None) or str(exc)


def count_lines(paths: Sequence[Path], limit: int, headers: bool = False) -> int:
    """The data lines of ``paths`` (less each file's header line, with ``headers``), counted no
    further than ``limit``."""
    total = 0
    for path in paths:
        with open_lines(path) as f:
            for number, _ in enumerate(bounded_lines(f), start=1):
                if headers and number == 1:
                    continue
                total += 1
                if total >= limit:
                    return total
    return total


def check_files(paths: Sequence[Path], parse: Parse, lines: int = CHECKED_LINES, header: Optional[Parse] = None,
                error: type[LineError] = LineError) -> None:
    """Raise ``error`` naming the first problem in the first ``lines`` lines of each file: none
    given, an empty or unreadable file, a truncated gzip stream, a malformed line (``header``
    reads each file's first line, when the format has one), files of headers and no data line."""
    if not paths:
        raise error("no data files")
    data_lines, cut = 0, False
    for path in paths:
        seen = 0
        try:
            with open_lines(path) as f:
                for seen, line in enumerate(bounded_lines(f), start=1):
                    (header if header is not None and seen == 1 else parse)(line, f"{path}:{seen}")
                    if seen >= lines:
                        cut = True
                        break
        except (OSError, EOFError) as exc:
            raise error(f"{path}: cannot be read past line {seen}: {why(exc)}") from None
        if seen == 0:
            raise error(f"{path} is empty")
        data_lines += seen - (header is not None)
    if not data_lines and not cut:
        raise error(f"{paths[0] if len(paths) == 1 else paths[0].parent}: no data lines, only "
                    f"{'a header' if len(paths) == 1 else 'headers'}")


@dataclass(kw_only=True)
class Skips:
    """What a reader skipped: counted, the first ``REASONS`` reasons kept, and said in the log
    (each of the first skips, then at most one line every ``SKIP_LOG_SECONDS``)."""

    logged: bool = True             # say why a record is skipped in the log (else only count it, and keep why)
    skipped: int = 0
    last_skip: Optional[str] = None
    reasons: list[str] = field(default_factory=list)    # why the first REASONS records were skipped
    _logged: tuple[float, int] = field(default=(float("-inf"), 0), init=False, repr=False)   # (when, skipped) last said

    def skip(self, why: str) -> None:
        self.skipped += 1
        self.last_skip = why
        if len(self.reasons) < REASONS:
            self.reasons.append(why)
        if not self.logged:
            return
        now = time.monotonic()
        if self.skipped <= _LOGGED_SKIPS or now - self._logged[0] >= SKIP_LOG_SECONDS:
            unsaid = self.skipped - self._logged[1] - 1
            log.warning("skipped: %s (%d skipped so far%s)", why, self.skipped,
                        f"; {unsaid} more since the last such line" if unsaid else "")
            self._logged = (now, self.skipped)


@dataclass
class Lines(Skips, Generic[T]):
    """One trainer's share of the data lines of ``paths``, read once through (an epoch), each as
    ``parse`` reads it; the lines it cannot read are skipped and counted. ``header``: each file's
    first line is read by it instead, and is not a data line."""

    paths: Sequence[Path]
    parse: Parse
    share: int = 0
    shares: int = 1
    start: int = 0                  # data lines passed over unread first (held out, or read before a restart)
    stop: Optional[int] = None      # no data line past this one is read
    header: Optional[Parse] = None
    lines: int = field(default=0, init=False)     # data lines of the files passed so far, every share's

    def __iter__(self) -> Iterator[T]:
        for path in self.paths:
            number = 0
            try:
                with open_lines(path) as f:
                    for number, line in enumerate(bounded_lines(f), start=1):
                        if self.header is not None and number == 1:
                            try:
                                self.header(line, f"{path}:1")
                            except LineError as exc:
                                self.skip(f"{exc}: the whole file is skipped")
                                break
                            continue
                        if self.stop is not None and self.lines >= self.stop:
                            return
                        self.lines += 1
                        if self.lines <= self.start or (self.lines - 1) % self.shares != self.share:
                            continue
                        try:
                            yield self.parse(line, f"{path}:{number}")
                        except LineError as exc:
                            self.skip(str(exc))
            except (OSError, EOFError) as exc:
                self.skip(f"{path}: the rest after line {number} cannot be read: {why(exc)}")


class OverLines:
    """A stream of batches over a reader of records (``_lines``: ``Lines``, or any format's rows):
    its skips and its position are that reader's."""

    _lines: Any

    @property
    def skipped(self) -> int:
        return self._lines.skipped

    @property
    def last_skip(self) -> Optional[str]:
        return self._lines.last_skip

    @property
    def lines(self) -> int:
        """Records of the files passed so far, every share's."""
        return self._lines.lines
