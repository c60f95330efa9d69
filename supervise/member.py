"""A member as ``rpcps up`` keeps it: how it was started, how often it died in a row and why,
whether it answers (``roster.py`` starts it; ``restarts.py`` says when it starts again)."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from supervise.placement import Placed


@dataclass
class Member:
    name: str
    role: str
    argv: list[str]
    url: str
    log_path: Path
    proc: Optional[Placed] = None
    started_at: float = 0.0                 # time.monotonic() of its last start
    deaths: int = 0                         # in a row: each before it stayed up --restart-window
    restarts: int = 0                       # in this run
    last_exit: Optional[int] = None
    restart_at: Optional[float] = None      # time.monotonic() its restart is due, while it waits
    log_start: int = 0                      # the size of its log at its last start: what follows is this run's
    causes: tuple[str, ...] = ()            # why it died, each of its deaths in a row
    fenced: Optional[str] = None            # why it was stopped as lost, until it is restarted
    answering: bool = False                 # its sidecar has answered since its last start: --member-timeout applies

    def healthy(self) -> None:
        """Up for --restart-window: its deaths no longer count as in a row."""
        self.deaths, self.causes = 0, ()

    def died_of(self, code: int) -> str:
        """Why it died this time, in words: its log's since its last start, or the signal."""
        if self.fenced is not None:
            return self.fenced
        if code < 0:
            return f"killed by signal {-code}"
        return cause(self.log_path, self.log_start)

    def failing(self) -> Optional[dict]:
        """What ``rpcps status`` shows of a member in a crash loop (None: not failing)."""
        if not self.deaths:
            return None
        due = None if self.restart_at is None else time.time() + max(0.0, self.restart_at - time.monotonic())
        return {"exit_code": self.last_exit, "deaths": self.deaths, "restart_at": due}


_TAIL = 1 << 16          # bytes of a log's end read for why its role died
_LOGGED_ERROR = re.compile(r" (ERROR|CRITICAL) [\w.]+: (.*)$")


def cause(log_path: Path, start: int = 0) -> str:
    """Why a role died, from its log past byte ``start``: its last logged error, else the last
    line of its last traceback, else its last line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - _TAIL))
            text = f.read().decode(errors="replace")
        lines = [line for line in text.splitlines()[-400:] if line.strip()]
    except OSError as exc:
        return f"its log cannot be read ({exc.strerror or exc})"
    errors = [m.group(2) for line in lines if (m := _LOGGED_ERROR.search(line))]
    if errors:
        return errors[-1]
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if tracebacks:
        after = [line for line in lines[tracebacks[-1] + 1:] if not line.startswith((" ", "\t"))]
        if after:
            return after[0]
    return lines[-1] if lines else "its log is empty"
