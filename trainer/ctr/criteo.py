"""The Criteo format, read as a stream and written from the generator.

A line is 40 tab-separated fields: the label (0 or 1), 13 integer counts and 26 categorical values
(8 hexadecimal digits); any field but the label may be empty. A file is plain text or gzip (told by
its first bytes), read a line at a time, so a day file of tens of gigabytes is never in memory.

Trainer ``k`` of ``n`` takes lines ``k, k + n, k + 2n, …`` of the files in order: disjoint shares
that together are the whole data. Counts become ``log1p(max(count, 0))`` as DLRM feeds them; a
categorical value is hashed to 64 bits with its feature's index (equal values of two features are
different rows) and reduced modulo its table's size; an empty one is a value of its own.

What a line may hold, so that no value in a file can crash a trainer: a label ``0`` or ``1``;
counts of ASCII digits with an optional ``-`` that fit in 64 bits (a negative one counts as 0); a
categorical value of at most 8 hexadecimal digits; at most ``MAX_LINE`` bytes in all, UTF-8. A
byte-order mark at a file's start is skipped. Anything else makes the line malformed: a
``CriteoError`` naming the file and line, and quoting at most ``QUOTED`` characters of the value
(with its length). ``check`` reads the first lines of every file before anything starts; while
training, ``CriteoStream`` skips and counts what it cannot read, and says why in its log (each of
the first skips, then at most one line every ``SKIP_LOG_SECONDS``).
"""
from __future__ import annotations

import gzip
import io
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Optional, Sequence

import numpy as np

from ps.hashing import hashed
from trainer.ctr.synthetic import DENSE, Batch, SyntheticCtr

log = logging.getLogger(__name__)

CATEGORICAL = 26
FIELDS = 1 + DENSE + CATEGORICAL
CHECKED_LINES = 1000           # lines of each file read by ``check`` before anything starts
_EMPTY = 1 << 32               # the value of an empty categorical field (real values are 32-bit)
_SALT = 0x43524954             # the hash stream of categorical values
MAX_LINE = 4096                # bytes a line may have (a real one has under 800)
QUOTED = 40                    # characters of a value an error message quotes
SKIP_LOG_SECONDS = 10.0        # after the first few, one log line at most this often about skipped lines
_LOGGED_SKIPS = 10             # skipped lines each logged on their own
_BOM = b"\xef\xbb\xbf"
_INT64 = (1 << 63) - 1


class CriteoError(ValueError):
    """A line or file that is not in the Criteo format; the message names the file and line."""


@dataclass
class Parsed:
    label: float
    counts: list[int]            # -1 where empty
    values: list[int]            # 32-bit values, _EMPTY where empty


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


def quoted(value: str, limit: int = QUOTED) -> str:
    """``value`` as an error message quotes it: at most ``limit`` characters, and its length if longer."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value):,} characters)"


def parse(line: bytes | int, where: str) -> Parsed:
    """A line (or the length of one too long to read, from ``bounded_lines``), or ``CriteoError``."""
    if isinstance(line, int):
        raise CriteoError(f"{where}: the line is {line:,} bytes long; a line may have at most {MAX_LINE:,}")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CriteoError(f"{where}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})") from None
    fields = text.rstrip("\r\n").split("\t")
    if len(fields) != FIELDS:
        raise CriteoError(f"{where}: expected {FIELDS} tab-separated fields (label, {DENSE} counts, "
                          f"{CATEGORICAL} categorical values), found {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise CriteoError(f"{where}: the label (field 1) must be 0 or 1, got {quoted(fields[0])}")
    return Parsed(float(fields[0]), _counts(fields[1:1 + DENSE], where), _categoricals(fields[1 + DENSE:], where))


def _counts(fields: list[str], where: str) -> list[int]:
    """The counts (-1 where empty). Checked for the whole line at once while every one is
    plainly well-formed (the common case), else one by one for the sentence."""
    body = "".join(fields)
    if body.isascii() and body.replace("-", "").isdigit() and max(map(len, fields)) <= 18:
        try:
            return [int(value) if value else -1 for value in fields]
        except ValueError:       # a "-" out of place
            pass
    return [_count(value, j, where) if value else -1 for j, value in enumerate(fields)]


def _categoricals(fields: list[str], where: str) -> list[int]:
    """The categorical values (_EMPTY where empty), checked as ``_counts`` checks counts."""
    body = "".join(fields)
    if body.isascii() and body.isalnum() and "x" not in body and "X" not in body and max(map(len, fields)) <= 8:
        try:
            return [int(value, 16) if value else _EMPTY for value in fields]
        except ValueError:
            pass
    return [_categorical(value, j, where) if value else _EMPTY for j, value in enumerate(fields)]


# str methods before int(), which also takes "1_000", " 7", "+7", other scripts' digits and "0x1f".
def _count(value: str, j: int, where: str) -> int:
    """Count I{j+1}, not empty: an integer of 64 bits."""
    digits = value[1:] if value[0] == "-" else value
    if not (digits.isascii() and digits.isdigit()):
        raise CriteoError(f"{where}: count I{j + 1} (field {j + 2}) is not an integer: {quoted(value)}")
    if len(digits) > 18 and (len(digits) > 19 or abs(int(value)) > _INT64):    # 18 digits always fit
        raise CriteoError(f"{where}: count I{j + 1} (field {j + 2}) does not fit in 64 bits: {quoted(value)}")
    return int(value)


def _categorical(value: str, j: int, where: str) -> int:
    """Categorical C{j+1}, not empty: 1 to 8 hexadecimal digits."""
    if len(value) <= 8 and value.isascii() and value.isalnum() and "x" not in value and "X" not in value:
        try:
            return int(value, 16)
        except ValueError:
            pass
    raise CriteoError(f"{where}: categorical C{j + 1} (field {j + 2 + DENSE}) is not 1 to 8 hexadecimal "
                      f"digits: {quoted(value)}")


def check(paths: Sequence[Path], lines: int = CHECKED_LINES) -> None:
    """Raise ``CriteoError`` naming the first problem in the first ``lines`` lines of each file:
    an empty or unreadable file, a truncated gzip stream, a malformed line."""
    if not paths:
        raise CriteoError("no data files")
    for path in paths:
        seen = 0
        try:
            with open_lines(path) as f:
                for seen, line in enumerate(bounded_lines(f), start=1):
                    parse(line, f"{path}:{seen}")
                    if seen >= lines:
                        break
        except (OSError, EOFError) as exc:
            raise CriteoError(f"{path}: cannot be read past line {seen}: {_why(exc)}") from None
        if seen == 0:
            raise CriteoError(f"{path} is empty")


def _why(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "the gzip stream is truncated"
    if isinstance(exc, gzip.BadGzipFile):
        return f"not a valid gzip file ({exc})"
    return getattr(exc, "strerror", None) or str(exc)


def row_ids(values: np.ndarray, cardinalities: Sequence[int]) -> np.ndarray:
    """[B, 26] 32-bit values (or _EMPTY) to row ids: hashed with the feature's index, modulo its
    size; a size of 0 keeps the 64-bit hash itself (as int64), the raw id a hashed table takes."""
    fields = np.arange(values.shape[1], dtype=np.int64)[None, :]
    h = hashed(_SALT, fields, values)
    sizes = np.array(cardinalities, dtype=np.uint64)[None, :]
    return np.where(sizes > 0, h % np.maximum(sizes, np.uint64(1)), h).view(np.int64)


@dataclass
class CriteoStream:
    """Batches of one trainer's share of Criteo files, read once through (an epoch)."""

    paths: Sequence[Path]
    cardinalities: Sequence[int]
    share: int = 0
    shares: int = 1
    skipped: int = 0
    last_skip: Optional[str] = None
    start: int = 0                  # lines passed over unread first (held out, or read before a restart)
    stop: Optional[int] = None      # no line past this one is read
    lines: int = field(default=0, init=False)     # lines of the files passed so far, every share's
    _logged: tuple[float, int] = field(default=(float("-inf"), 0), init=False, repr=False)   # (when, skipped) last said

    def batches(self, size: int) -> Iterator[Batch]:
        labels, counts, values = [], [], []
        for parsed in self._mine():
            labels.append(parsed.label)
            counts.append(parsed.counts)
            values.append(parsed.values)
            if len(labels) == size:
                yield self._batch(labels, counts, values)
                labels, counts, values = [], [], []
        if labels:
            yield self._batch(labels, counts, values)

    def _mine(self) -> Iterator[Parsed]:
        for path in self.paths:
            number = 0
            try:
                with open_lines(path) as f:
                    for number, line in enumerate(bounded_lines(f), start=1):
                        if self.stop is not None and self.lines >= self.stop:
                            return
                        self.lines += 1
                        if self.lines <= self.start or (self.lines - 1) % self.shares != self.share:
                            continue
                        try:
                            yield parse(line, f"{path}:{number}")
                        except CriteoError as exc:
                            self._skip(str(exc))
            except (OSError, EOFError) as exc:
                self._skip(f"{path}: the rest after line {number} cannot be read: {_why(exc)}")

    def _skip(self, why: str) -> None:
        self.skipped += 1
        self.last_skip = why
        now = time.monotonic()
        if self.skipped <= _LOGGED_SKIPS or now - self._logged[0] >= SKIP_LOG_SECONDS:
            unsaid = self.skipped - self._logged[1] - 1
            log.warning("skipped: %s (%d skipped so far%s)", why, self.skipped,
                        f"; {unsaid} more since the last such line" if unsaid else "")
            self._logged = (now, self.skipped)

    def _batch(self, labels: list[float], counts: list[list[int]], values: list[list[int]]) -> Batch:
        raw = np.array(counts, dtype=np.int64)
        return Batch(dense=np.log1p(np.maximum(raw, 0)).astype(np.float32),
                     ids=row_ids(np.array(values, dtype=np.int64), self.cardinalities),
                     labels=np.array(labels, dtype=np.float32), p=np.full(len(labels), np.nan), counts=raw)


def write(generator: SyntheticCtr, indices: np.ndarray, out: IO[str], chunk: int = 8192) -> int:
    """The generator's samples ``indices`` as Criteo lines (categorical values as 8 hex digits of
    a hash of (feature, id)); the number of lines written."""
    written = 0
    for start in range(0, len(indices), chunk):
        b = generator.batch(indices[start:start + chunk])
        hexes = (hashed(_SALT + 1, np.arange(CATEGORICAL)[None, :], b.ids) & np.uint64(0xFFFFFFFF)).astype(np.int64)
        buf = io.StringIO()
        for label, counts, values in zip(b.labels, b.counts, hexes):
            dense = "\t".join("" if c < 0 else str(c) for c in counts)
            buf.write(f"{int(label)}\t{dense}\t" + "\t".join(f"{v:08x}" for v in values) + "\n")
        out.write(buf.getvalue())
        written += len(b.labels)
    return written
