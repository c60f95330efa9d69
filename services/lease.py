"""A member's lease with its supervisor, and what it does when the lease runs out: it fences itself.

``rpcps up`` asks every member's ``/healthz`` each second with the ``X-Rpcps-Lease`` header
(``services/liveness.py``), and declares a member silent for ``--member-timeout`` lost, kills it
where it runs and starts a replacement. A member whose host cannot be reached cannot be killed,
so the member keeps the other side of the bargain: started with a lease (``RPCPS_LEASE_TIMEOUT``,
which ``rpcps up`` sets to its ``--member-timeout``), it exits with ``FENCED`` once it has not been
asked for that long since it was last asked. Its supervisor stops hearing it no earlier than it
stops being asked, so it is gone before its supervisor declares it lost, and no old incarnation
serves beside a replacement. A member started by hand, compose or Kubernetes has no lease unless
told, and never fences itself.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

LEASE_HEADER = "X-Rpcps-Lease"
FENCED = 76        # the exit code of a member that fenced itself: its supervisor replaces it as lost
CUT_OFF_AFTER = 3.0     # seconds without a renewal (asked each second) that say this member is the one cut off


class Lease:
    """When the supervisor last renewed this member's lease; expired once ``timeout`` seconds
    have passed since a renewal (before the first renewal there is nothing to expire: the
    supervisor's start-up deadline applies)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self._clock = timeout, clock
        self._lock = threading.Lock()
        self._renewed: Optional[float] = None

    def renew(self) -> None:
        with self._lock:
            self._renewed = self._clock()

    def silent_for(self) -> float:
        """Seconds since the last renewal (0 before the first)."""
        with self._lock:
            renewed = self._renewed
        return 0.0 if renewed is None else self._clock() - renewed

    def cut_off(self) -> bool:
        """Whether its supervisor's asks have stopped coming: when a peer falls silent too, this
        member is the one cut off, and it is for its lease to fence it, not for it to leave."""
        return self.silent_for() > CUT_OFF_AFTER

    def expired(self) -> Optional[float]:
        """The seconds since the last renewal, once past the timeout; else None."""
        silent = self.silent_for()
        return silent if silent > self.timeout else None

    def watch(self, fence: Callable[[float], None], every: float = 0.25) -> threading.Thread:
        """Call ``fence(seconds)`` from a thread of its own once the lease has expired."""
        def run() -> None:
            while (silent := self.expired()) is None:
                time.sleep(every)  # noqa: sleep-ok (a watch of the clock, not a synchronisation)
            fence(silent)
        thread = threading.Thread(target=run, name="lease", daemon=True)
        thread.start()
        return thread
