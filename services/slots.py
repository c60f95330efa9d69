"""A process-wide reference that a role sets once and RPC entry points read.

RPC calls module-level functions by name, so the object they act on (the process's server, agent,
checkpoint coordinator …) has to be reachable from module scope; a slot is that, behind a lock."""
from __future__ import annotations

import threading
from typing import Any

from services.errors import NotReady


class Slot:
    def __init__(self, what: str) -> None:
        self._lock = threading.Lock()
        self._value: Any = None
        self._what = what

    def set(self, value: Any) -> None:
        with self._lock:
            self._value = value

    def get(self) -> Any:
        with self._lock:
            if self._value is None:
                raise NotReady(f"no {self._what} in this process yet")
            return self._value
