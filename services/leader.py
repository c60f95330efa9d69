"""Noticing, on every other member, that the leader is gone.

The leader hosts the rendezvous store and leads membership, and torch 2.13 can neither move those
to another process nor repair a group whose store host died
(``../shared/research/torch-rpc-facts.md`` Q1: re-initialising RPC in a process needs private
state reset, and every survivor's agent keeps pipes to the dead one). So a member that loses the
leader leaves: it hands over what it alone holds (a server's shard, ``checkpoint/handover.py``),
exits with ``LEADER_LOST``, and its supervisor (``rpcps up``, compose's restart policy, Kubernetes)
starts it again at once; the new process joins the new leader's group. What is lost is the dead
leader's own state since its last checkpoint, and the trainers' steps since then are replayed.

The watch probes the leader's store, not its RPC: the store is served by a thread of its own, so
a leader busy in Python (a checkpoint, a long step) still answers, and only a dead, hung or
unreachable host misses. Each leader writes an id of its own into the store when it joins, so a
member whose store client reconnected to a *new* leader's store also knows its group is gone.

A leader that does not answer in time (frozen, or cut off from this member) is not gone yet
when a supervisor with a deadline of its own watches both (``silence``: the lease it gave this
member, ``services/lease.py``): it fences whichever of the two is silent within that deadline,
and a dead leader's refused connections still count at once.

The same watch notices that the leader has *evicted* this member (it was stopped or cut off past
the leader's liveness probes, ``services/membership.py``): the group has gone on without it, and
it leaves and rejoins the same way, keeping what it holds.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

LEADER_LOST = 75          # the exit code (EX_TEMPFAIL) of a member that lost its leader: restart it now
LEADER_KEY = "rpcps/leader"
PROBE_INTERVAL = 1.0      # seconds between probes
PROBE_MISSES = 2          # missed probes in a row that mean the leader is gone
PROBE_TIMEOUT = 3.0       # seconds one probe may take (a hung host)


class LeaderWatch:
    """Probes the leader every ``interval`` seconds; after ``misses`` failures in a row, or at once
    when another leader answers, calls ``on_lost(why)`` once. ``probe()`` returns the id of the
    leader that answered, or raises."""

    def __init__(self, probe: Callable[[], str], on_lost: Callable[[str], None],
                 interval: float = PROBE_INTERVAL, misses: int = PROBE_MISSES,
                 evicted: Optional[Callable[[], bool]] = None, silence: Optional[float] = None,
                 cut_off: Optional[Callable[[], bool]] = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``evicted()``: whether the leader has removed this member from its group. ``silence``:
        seconds a leader that answers nothing in time is given (None: a miss like any other).
        ``cut_off()``: whether this member itself is cut off (its supervisor's asks stopped too):
        then a silent leader is never taken for a lost one, and the member's lease fences it."""
        self._probe, self._on_lost, self._evicted = probe, on_lost, evicted
        self.interval, self.misses, self.silence, self._cut_off = interval, misses, silence, cut_off
        self._clock = clock
        self._answered = clock()        # when the leader last answered
        self._silent = False            # whether its last probe went unanswered in time
        self._lock = threading.Lock()   # the watch's thread and a failed step's verdict both probe
        self.leader: Optional[str] = None      # the id of the leader whose group this member joined
        self.lost = threading.Event()
        self._missed = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "LeaderWatch":
        self.leader = self._probe()
        self._thread = threading.Thread(target=self._run, name="leader-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> Optional[str]:
        """One probe now: why this member is no longer in its leader's group, or None while it is."""
        with self._lock:
            return self._check()

    def verdict(self) -> Optional[str]:
        """After a failure: ``check``, asked again while the leader is silent until it answers or
        its silence runs past the deadline; a step that timed out on a frozen leader must not be
        taken for this member's own failure."""
        why = self.check()
        while why is None and self._silent and not self.lost.is_set() and not self._stop.is_set():
            self._stop.wait(self.interval)
            why = self.check()
        return why

    def _check(self) -> Optional[str]:
        if self.lost.is_set():
            return "the leader was lost"
        try:
            answered = self._probe()
            evicted = self._evicted is not None and self._evicted()
        except Exception as exc:  # noqa: BLE001 - any failure to reach the store is a miss
            said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._silent = self.silence is not None and _timed_out(exc)
            if self._silent:
                silent = self._clock() - self._answered
                if silent < self.silence or (self._cut_off is not None and self._cut_off()):
                    return None             # the supervisor's deadline judges a silent leader, or this member
                self._missed = self.misses
                return f"the leader is gone: its store has not answered for {silent:.0f}s ({said})"
            self._missed += 1
            return f"the leader is gone: its store did not answer {self._missed} probe(s) in a row ({said})"
        self._answered, self._silent = self._clock(), False
        if self.leader is not None and answered != self.leader:
            self._missed = self.misses
            return f"the leader is gone: another leader ({answered}) answers in its place"
        if evicted:
            self._missed = self.misses
            return "the leader removed this member from the group: it missed the leader's liveness probes " \
                   "(stopped, or cut off)"
        self._missed = 0
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            why = self.check()
            if why is not None and self._missed >= self.misses:
                self.lost.set()
                log.warning("%s; leaving, to rejoin the group", why)
                self._on_lost(why)
                return


def _timed_out(exc: BaseException) -> bool:
    """Whether a probe failed for want of an answer in time, rather than being refused."""
    return isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
