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
(with its length), which ``rpcps/data/lines.py`` handles as it does any format's: found before
anything starts in a file's first lines, skipped and counted while training.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Optional, Sequence

import numpy as np

from ps.spec.hashing import hashed
from rpcps.data.generated import CATEGORICAL, DENSE, Samples, SyntheticCtr
from rpcps.data.lines import CHECKED_LINES, MAX_LINE, LineError, Lines, OverLines, check_files, quoted, text_of

FIELDS = 1 + DENSE + CATEGORICAL
_EMPTY = 1 << 32               # the value of an empty categorical field (real values are 32-bit)
_SALT = 0x43524954             # the hash stream of categorical values
_INT64 = (1 << 63) - 1


class CriteoError(LineError):
    """A line or file that is not in the Criteo format; the message names the file and line."""


@dataclass
class Parsed:
    label: float
    counts: list[int]            # -1 where empty
    values: list[int]            # 32-bit values, _EMPTY where empty


def parse(line: bytes | int, where: str) -> Parsed:
    """A line (or the length of one too long to read, from ``bounded_lines``), or ``CriteoError``."""
    text = text_of(line, where, CriteoError)
    fields = text.split("\t")
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
    check_files(paths, parse, lines, error=CriteoError)


def table_sizes(cardinalities: Sequence[int], hashed: Sequence[int]) -> list[int]:
    """What ``row_ids`` reduces each feature's hash modulo: its table's rows, or 0 for a table in
    ``hashed`` (keyed by the raw 64-bit hash itself)."""
    keyed = set(hashed)
    return [0 if t in keyed else rows for t, rows in enumerate(cardinalities)]


def row_ids(values: np.ndarray, cardinalities: Sequence[int]) -> np.ndarray:
    """[B, 26] 32-bit values (or _EMPTY) to row ids: hashed with the feature's index, modulo its
    size; a size of 0 keeps the 64-bit hash itself (as int64), the raw id a hashed table takes."""
    fields = np.arange(values.shape[1], dtype=np.int64)[None, :]
    h = hashed(_SALT, fields, values)
    sizes = np.array(cardinalities, dtype=np.uint64)[None, :]
    return np.where(sizes > 0, h % np.maximum(sizes, np.uint64(1)), h).view(np.int64)


@dataclass
class CriteoStream(OverLines):
    """Batches of one trainer's share of Criteo files, read once through (an epoch)."""

    paths: Sequence[Path]
    cardinalities: Sequence[int]
    share: int = 0
    shares: int = 1
    start: int = 0                  # lines passed over unread first (held out, or read before a restart)
    stop: Optional[int] = None      # no line past this one is read
    _lines: Lines = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lines = Lines(self.paths, parse, self.share, self.shares, self.start, self.stop)

    def batches(self, size: int) -> Iterator[Samples]:
        labels, counts, values = [], [], []
        for parsed in self._lines:
            labels.append(parsed.label)
            counts.append(parsed.counts)
            values.append(parsed.values)
            if len(labels) == size:
                yield self._batch(labels, counts, values)
                labels, counts, values = [], [], []
        if labels:
            yield self._batch(labels, counts, values)

    def _batch(self, labels: list[float], counts: list[list[int]], values: list[list[int]]) -> Samples:
        return batch_of(labels, counts, values, self.cardinalities)


def batch_of(labels: list[float], counts: list[list[int]], values: list[list[int]], cardinalities: Sequence[int]
             ) -> Samples:
    """Parsed lines as a batch: the counts' ``log1p`` (0 below 0 or empty), the values' row ids."""
    raw = np.array(counts, dtype=np.int64).reshape(len(labels), DENSE)
    return Samples(dense=np.log1p(np.maximum(raw, 0)).astype(np.float32),
                 ids=row_ids(np.array(values, dtype=np.int64).reshape(len(labels), CATEGORICAL), cardinalities),
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
