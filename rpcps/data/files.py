"""The files ``--data`` names: which, in what order, and whether their first records are in the
format they are read as, checked before anything starts."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rpcps.data.lines import CHECKED_LINES, LineError

if TYPE_CHECKING:
    from rpcps.schema import Schema


def data_files(data: Optional[Path]) -> list[Path]:
    """The files ``--data`` names, in the order they are read: a file, or a folder's files in name
    order (hidden ones, as a file being written and renamed into place, left out)."""
    if data is None:
        return []
    if data.is_dir():
        return sorted(p for p in data.iterdir() if p.is_file() and not p.name.startswith("."))
    return [data]


def _unreadable(data: Path, exc: OSError) -> str:
    """Why ``--data`` cannot be opened, in words."""
    if exc.errno == errno.ELOOP:
        return f"{data} is a loop of symbolic links"
    if isinstance(exc, FileNotFoundError):
        return f"{data} is a symbolic link to {os.readlink(data)}, which does not exist" if data.is_symlink() \
            else f"{data} does not exist"
    return f"{data} cannot be read: {exc.strerror or exc}"


FOLLOWED_CHECKED = 4          # a followed folder's newest files checked at a start (it may hold thousands)


def checked_data(data: Optional[Path], schema: "Optional[Schema]" = None, *, follow: bool = False) -> None:
    """A ``ValueError`` saying why ``data`` cannot be read, or naming the first record of its first
    ``CHECKED_LINES`` in each file that is not in its format (Criteo's, or ``schema``'s): refused
    before anything starts, with the file and line. ``follow``: a folder files land in, which may
    have none yet, and whose newest ``FOLLOWED_CHECKED`` are checked (the others may be read already)."""
    if data is None:
        return
    try:
        data.stat()
    except OSError as exc:
        raise ValueError(_unreadable(data, exc)) from None
    paths = data_files(data)
    if follow and data.is_dir():
        if not paths:
            return
        paths = paths[-FOLLOWED_CHECKED:]
    from rpcps.data.formats import reader_of
    try:
        reader_of(schema).check(schema, paths, CHECKED_LINES)
    except LineError as exc:
        raise ValueError(str(exc) if paths else f"{data} holds no data files") from None
