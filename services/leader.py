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

The same watch notices that the leader has *evicted* this member (it was stopped or cut off past
the leader's liveness probes, ``services/membership.py``): the group has gone on without it, and
it leaves and rejoins the same way, keeping what it holds.
"""
from __future__ import annotations

import logging
import threading
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
                 evicted: Optional[Callable[[], bool]] = None) -> None:
        """``evicted()``: whether the leader has removed this member from its group."""
        self._probe, self._on_lost, self._evicted = probe, on_lost, evicted
        self.interval, self.misses = interval, misses
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
        if self.lost.is_set():
            return "the leader was lost"
        try:
            answered = self._probe()
            evicted = self._evicted is not None and self._evicted()
        except Exception as exc:  # noqa: BLE001 - any failure to reach the store is a miss
            self._missed += 1
            return f"the leader is gone: its store did not answer {self._missed} probe(s) in a row " \
                   f"({str(exc).splitlines()[0]})"
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
