"""What a server did with its rows: how many it looked up and updated, and the seconds it spent
on each, so its rows/s is the work's own rate, whatever the trainers wait on around it."""
from __future__ import annotations

import threading

KINDS = ("lookup", "update")


class Work:
    def __init__(self) -> None:
        self._lock = threading.Lock()       # lookups run on many RPC threads at once
        self._rows = dict.fromkeys(KINDS, 0)
        self._seconds = dict.fromkeys(KINDS, 0.0)

    def add(self, kind: str, rows: int, seconds: float) -> None:
        with self._lock:
            self._rows[kind] += rows
            self._seconds[kind] += seconds

    def describe(self) -> dict[str, dict[str, float]]:
        """Per kind: rows, seconds, rows_per_s (0 before any)."""
        with self._lock:
            return {k: {"rows": self._rows[k], "seconds": round(self._seconds[k], 6),
                        "rows_per_s": self._rows[k] / self._seconds[k] if self._seconds[k] else 0.0}
                    for k in KINDS}
