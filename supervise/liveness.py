"""Deadlines for members that hang: when each member last answered its sidecar, as ``rpcps up``
sees it. A process that dies resets its sockets and its supervisor sees it exit; a frozen one (a
stopped process, a paused host) or one cut off from the network does neither, and whoever waits
on it would wait for ever. So every member's ``/healthz`` is asked, by a thread of its own so that
one member's silence delays no other's answer, and a member silent for ``--member-timeout`` is
declared lost although its process lives (``Launcher`` then fences it: stops it through its
placement, and the restart path replaces it). Each ask renews the member's lease
(``services/lease.py``): a member no longer asked for the timeout fences itself. Any HTTP answer counts, a 503 included: a member that
says it is unhealthy is alive, and busy work (a long checkpoint, a CPU quota used up) leaves its
sidecar's thread time to answer."""
from __future__ import annotations

import threading
import time
import uuid
from typing import Optional

import httpx

from services.lease import LEASE_HEADER, Ask

PROBE_EVERY = 1.0       # seconds between asks of one member that answered the last
# After an ask not answered, the next comes five times as soon: a member starting is heard as soon
# as its sidecar listens, so that one freezing a moment later (in the first steps of a change of
# layout it was started for) is judged by --member-timeout, not by the longer --ready-timeout.
# A frozen member's ask waits out its timeout anyway.
UNANSWERED_SOONER = 5
PROBE_TIMEOUT = 2.0     # seconds one ask may take


class Liveness:
    """The last answer of each watched member, ``time.monotonic()``, and which are overdue: silent
    past ``member_timeout`` since an answer after their last start, or past ``ready_timeout``
    without one. ``close`` ends the threads."""

    def __init__(self, member_timeout: float, ready_timeout: float, every: float = PROBE_EVERY,
                 timeout: float = PROBE_TIMEOUT) -> None:
        self.member_timeout, self.ready_timeout = member_timeout, ready_timeout
        self.every, self.timeout = every, timeout
        self._lock = threading.Lock()
        self._answered: dict[str, float] = {}
        self._asked: dict[str, int] = {}       # asks made of each, answered or not
        self._urls: dict[str, str] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._asker = uuid.uuid4().hex[:12]

    def watch(self, name: str, url: str) -> None:
        """Ask ``name``'s sidecar at ``url`` from now on (a member restarted elsewhere: its new URL)."""
        with self._lock:
            known = name in self._urls
            self._urls[name] = url
        if not known:
            thread = threading.Thread(target=self._ask, args=(name,), name=f"liveness-{name}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def last_answer(self, name: str) -> Optional[float]:
        with self._lock:
            return self._answered.get(name)

    def heard_since(self, name: str, started_at: float) -> bool:
        """Whether ``name`` has answered since ``started_at`` (its last start)."""
        answered = self.last_answer(name)
        return answered is not None and answered >= started_at

    def overdue(self, name: str, started_at: float, now: float) -> Optional[float]:
        """The seconds ``name`` (last started at ``started_at``) has been silent, once past what it
        is allowed; else None."""
        if self.heard_since(name, started_at):
            silent, allowed = now - self.last_answer(name), self.member_timeout
        else:
            silent, allowed = now - started_at, self.ready_timeout
        return silent if silent > allowed else None

    def asked(self, name: str) -> int:
        with self._lock:
            return self._asked.get(name, 0)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + self.every + 1.0)

    def _ask(self, name: str) -> None:
        with httpx.Client(timeout=self.timeout) as http:
            while not self._stop.is_set():
                with self._lock:
                    url = self._urls[name]
                ask = Ask(time.monotonic(), self.timeout, self._asker)
                try:
                    http.get(f"{url.rstrip('/')}/healthz", headers={LEASE_HEADER: ask.header(self.member_timeout)})
                    # httpx's timeout bounds each phase; the member renews only on asks answered
                    # within the whole of it, and so does this side.
                    answered = time.monotonic() - ask.sent <= self.timeout
                except Exception:  # noqa: BLE001 - whatever kept the answer away, it is silence, and asking goes on
                    answered = False
                with self._lock:
                    self._asked[name] = self._asked.get(name, 0) + 1
                    if answered:
                        self._answered[name] = time.monotonic()
                self._stop.wait(self.every if answered else self.every / UNANSWERED_SOONER)
