"""A member's lease with its supervisor, and what it does when the lease runs out: it fences itself.

``rpcps up`` asks every member's ``/healthz`` each second with the ``X-Rpcps-Lease`` header
(``supervise/liveness.py``), and declares a member silent for ``--member-timeout`` lost, kills it
where it runs and starts a replacement. A member whose host cannot be reached cannot be killed,
so the member keeps the other side of the bargain: started with a lease (``RPCPS_LEASE_TIMEOUT``,
which ``rpcps up`` sets to its ``--member-timeout``), it exits with ``FENCED`` once it has not been
asked for that long since it was last asked. Its supervisor stops hearing it no earlier than it
stops being asked, so it is gone before its supervisor declares it lost, and no old incarnation
serves beside a replacement. A member started by hand, compose or Kubernetes has no lease unless
told, and never fences itself.

An ask can reach a member long after it was sent: one queued while the member was frozen, or
retransmitted once a cut link is back, is answered to an asker that gave up on it. Renewing on it
would let the member outlive its supervisor's deadline by as long. So each ask says when it was
sent (its asker's monotonic clock) and how long its asker waits; the member renews from the send
time, read on its own clock through the smallest gap seen (a clock offset between hosts is
constant), and not at all on an ask older than its asker's wait. What remains is an answer lost
after the member sent it: the member may then outlive the deadline by one ask's period and wait
(3 s), less than a replacement takes to start.
"""
from __future__ import annotations

import logging
import math
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger(__name__)

LEASE_HEADER = "X-Rpcps-Lease"
FENCED = 76        # the exit code of a member that fenced itself: its supervisor replaces it as lost
CUT_OFF_AFTER = 3.0     # seconds without a renewal (asked each second) that say this member is the one cut off


DRIFT = 1e-3       # seconds per second the smallest gap may rise by: clocks of two hosts drift apart


@dataclass(frozen=True)
class Ask:
    """One renewal, as its header says it: when its asker sent it (the asker's ``time.monotonic()``),
    how long the asker waits for the answer, and which asker (a new one has another clock)."""
    sent: float
    within: float
    asker: str

    def header(self, timeout: float) -> str:
        return f"timeout={timeout:g};sent={self.sent:.6f};within={self.within:g};by={self.asker}"

    @classmethod
    def parse(cls, value: str) -> Optional["Ask"]:
        """The ask of a header; None for one without a send time (a renewal by hand: it counts now)."""
        fields = dict(part.split("=", 1) for part in value.split(";") if "=" in part)
        try:
            ask = cls(float(fields["sent"]), float(fields["within"]), fields["by"])
        except (KeyError, ValueError):
            return None
        # A NaN would compare false everywhere and leave a lease that never runs out.
        return ask if math.isfinite(ask.sent) and math.isfinite(ask.within) else None


class Lease:
    """When the supervisor last renewed this member's lease; expired once ``timeout`` seconds
    have passed since a renewal (before the first renewal there is nothing to expire: the
    supervisor's start-up deadline applies)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self._clock = timeout, clock
        self._lock = threading.Lock()
        self._renewed: Optional[float] = None
        self._asker: Optional[str] = None
        self._least = 0.0           # the smallest gap between an ask's arrival and its send time
        self._least_at = 0.0

    def renew(self, ask: Optional[Ask] = None) -> bool:
        """Renewed from ``ask``'s send time (now, for ``None``); False for an ask its asker gave up on."""
        now = self._clock()
        with self._lock:
            since = now
            if ask is not None:
                gap = now - ask.sent            # the clocks' offset, plus this ask's delay
                if ask.asker != self._asker:
                    self._asker, self._least = ask.asker, gap
                self._least = min(self._least + DRIFT * (now - self._least_at), gap)
                self._least_at = now
                delay = gap - self._least
                if delay > ask.within:
                    return False
                since = now - delay
            if self._renewed is None or since > self._renewed:
                self._renewed = since
            return True

    def silent_for(self) -> float:
        """Seconds since the last renewal (0 before the first)."""
        with self._lock:
            renewed = self._renewed
        return 0.0 if renewed is None else self._clock() - renewed

    def describe(self) -> dict:
        """What ``/healthz`` shows of it: the timeout, and the seconds since the last renewal
        (None before the first)."""
        with self._lock:
            renewed = self._renewed
        return {"timeout": self.timeout, "renewed_ago": None if renewed is None else round(self._clock() - renewed, 3)}

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


def requeue_orphaned(job: Optional[str], store: tuple[str, int], wait: float = 2.0) -> Optional[str]:
    """For a member of a Slurm job whose lease ran out: requeue the job if its batch node is lost.
    ``rpcps up`` and the leader's store run on the batch node; when the store cannot be reached
    either, but Slurm's controller can, the batch node is gone and nothing is left to supervise.
    Slurm would keep a job that outlives node failures (``--no-kill``) running without its
    batch script; requeued, it resumes from its newest checkpoint. A member cut off from
    everything reaches neither, and only fences itself. Says what it did (None: nothing)."""
    if not job or shutil.which("scontrol") is None:
        return None
    try:
        socket.create_connection(store, timeout=wait).close()
        return None                 # the batch node is there: this member alone was let go
    except OSError:
        pass
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=2 * wait)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None                 # the controller is out of reach too, or the job is over or requeued
    return f"its leader's store at {store[0]}:{store[1]} is out of reach: requeued Slurm job {job}"
