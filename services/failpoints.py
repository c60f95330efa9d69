"""Named points where a test freezes a member at an exact step (failpoints, as etcd's gofail or
TiKV's fail-rs do it): a process started with ``RPCPS_FAILPOINTS=relayout,adopt`` stops itself
with SIGSTOP the first time it reaches each named point. The test then kills it there, or lets it
go on (SIGCONT), instead of racing a step that lasts milliseconds with a signal from outside.
A point given as ``name=PATH`` stops only the first process of a job to reach it, the one that
creates ``PATH``: a supervisor's replacement of the member it stopped, started with the same
environment, goes past it. A point given as ``name!`` does not stop: it fails (raises
``FailpointError``) every time it is reached, as a step that keeps failing in a member that
answers on.

Unset, as everywhere but the suite, a point costs one lookup in an empty set. The points are
named where they are reached (``grep -rn 'reached(' ps services``); a change of layout's are
``part:<stage>`` (a source asked for its part), ``take:<stage>`` (a destination taking one),
``prepare``, ``relayout`` (a server's rebuild, before its gate closes) and ``adopt`` (the
leader, every server rebuilt, before it adopts the new layout).
"""
from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

VARIABLE = "RPCPS_FAILPOINTS"

_lock = threading.Lock()        # RPC handler threads reach points at once
_given = [p.strip() for p in os.environ.get(VARIABLE, "").split(",") if p.strip()]
_armed = dict(p.partition("=")[::2] for p in _given if not p.endswith("!"))
_failing = {p[:-1] for p in _given if p.endswith("!")}


class FailpointError(RuntimeError):
    """A step failed on purpose, at a failpoint armed to fail (``name!``)."""


def reached(point: str) -> None:
    """Stop this process here if ``point`` is armed and was not reached before (by this process;
    by any, for one armed with a path); fail here if it is armed to fail."""
    if point in _failing:
        raise FailpointError(f"failed at failpoint {point} ({VARIABLE})")
    if not _armed:
        return
    with _lock:
        if point not in _armed:
            return
        once = _armed.pop(point)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    log.warning("stopped at failpoint %s (pid %d)", point, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()         # the test reads the log to know where it stopped
    os.kill(os.getpid(), signal.SIGSTOP)
