"""The replicas' all-reduce: a sum over the trainers' process group that leaves the same bits on
every member, in as few waits as the group's size allows.

gloo's all-reduce is a ring: 2(N - 1) exchanges a call, each a wait on one peer, so every trainer
host added costs every step two more waits (what ``rpcps bench scale``'s step-time model fits as
a hop). Recursive halving and doubling (Thakur, Rabenseifner and Gropp, 2005) moves the same bytes
in 2·log2(N) exchanges between pairs: each round a member sends half of what it still sums to a
partner and adds the other half the partner sends; then the summed parts go back the same way. A
group that is not a power of two first folds each extra member into a partner and unfolds the
result to it last: two exchanges more. Each element's sum is formed once, by one member, and
copied to the others: the members end with equal bits, as the replicas need.

An exchange here costs more than a ring hop (its messages are larger, each a call from Python):
side by side (``rpcps bench ring``, emulated hosts, the DLRM's 1.9 MB) halving and doubling was
level with the ring at 4 and 5 members and 0.69-0.89 of its time at 6 and 8. So ``GroupSum``
runs it where it saves at least 4 exchanges (from 6 members), and gloo's ring below.

Failing fast. A member whose exchange fails (its partner died or left the group) aborts its
group, as after any failed collective, but gloo keeps that member's other connections open, and a
peer blocked in a point-to-point receive from it would wait out the group's timeout. Every
message therefore ends with a mark (1.0) in a slot the receiver fills with NaN before it
receives; a member that fails sends every other member a one-value message instead (gloo takes a
shorter message into a longer buffer), which leaves the receiver's mark unset: the receiver fails
at once and passes the news on. A message no peer takes within ``TELL_WITHIN`` (the peer waits
in a collective, or is done) is given up: gloo closes a connection whose wait timed out.
"""
from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_SENT = 1.0         # the mark a whole message ends with
TELL_WITHIN = 0.5   # seconds a failed member waits for the others to take the news


class GroupFailed(RuntimeError):
    """A member of the group failed in this all-reduce, or left the group."""


def ring_rounds(n: int) -> int:
    return 2 * (n - 1)


def halving_doubling_rounds(n: int) -> int:
    power = 1 << (n.bit_length() - 1)
    return 2 * (power.bit_length() - 1) + (2 if n > power else 0)


SAVED_AT_LEAST = 4  # exchanges halving and doubling must save to be run instead of the ring


def halving(n: int, saved_at_least: int = SAVED_AT_LEAST) -> bool:
    """Whether ``GroupSum`` sums over ``n`` members by halving and doubling (else gloo's ring)."""
    return ring_rounds(n) - halving_doubling_rounds(n) >= saved_at_least


def rounds(n: int) -> int:
    """The exchanges an all-reduce among ``n`` members waits on, by the algorithm ``GroupSum`` runs."""
    return halving_doubling_rounds(n) if halving(n) else ring_rounds(n)


class GroupSum:
    """Starts sums over the default process group, each as a future of its tensor: halving and
    doubling where it saves ``saved_at_least`` exchanges, on a thread of its own so that the caller
    (DDP's communication hook, inside a backward) is not held; else gloo's ring."""

    def __init__(self, saved_at_least: int = SAVED_AT_LEAST) -> None:
        self._saved_at_least = saved_at_least
        self._work: Optional[queue.SimpleQueue] = None
        self._lock = threading.Lock()
        self._pending: list[Any] = []      # sends never waited for (their receiver failed): kept alive

    def start(self, flat: torch.Tensor) -> torch.futures.Future:
        if not halving(dist.get_world_size(), self._saved_at_least):
            return dist.all_reduce(flat, async_op=True).get_future().then(lambda f: f.value()[0])
        done: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._work is None:
                self._work = queue.SimpleQueue()
                # A daemon: a member that exits while a peer never answers is not held at exit.
                threading.Thread(target=self._run, args=(self._work,), name="rpcps-allreduce", daemon=True).start()
            self._work.put((flat, done))
        return done

    def _tell_others(self) -> None:
        """Every other member: this one failed in the group's sum (see the module's docstring)."""
        me, pill = dist.get_rank(), torch.zeros(1)
        sends = []
        for peer in range(dist.get_world_size()):
            if peer != me:
                try:
                    sends.append(dist.isend(pill, peer))
                except Exception:  # noqa: BLE001 - a peer already gone needs no telling
                    pass
        deadline = time.monotonic() + TELL_WITHIN
        for sending in sends:
            try:
                sending.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - not taken in time: its connection is closed instead
                pass

    def _keep(self, work: Any) -> None:
        with self._lock:
            self._pending.append(work)

    def _run(self, work: queue.SimpleQueue) -> None:
        while True:
            flat, done = work.get()
            try:
                self.halving_doubling(flat)
            except Exception as exc:  # noqa: BLE001 - the caller's wait raises it
                try:
                    self._tell_others()
                except Exception as telling:  # noqa: BLE001 - the others fail on their own, later
                    log.warning("could not tell the trainers' group of a failed all-reduce: %s", telling)
                done.set_exception(exc)
            else:
                done.set_result(flat)

    def halving_doubling(self, flat: torch.Tensor) -> None:
        """``flat`` (1-D, contiguous) := its sum over the group, in place, by halving and
        doubling whatever the group's size, in this thread (``start`` chooses, on its own)."""
        rank, n = dist.get_rank(), dist.get_world_size()
        power = 1 << (n.bit_length() - 1)
        if rank >= power:                  # an extra member: its tensor to its partner, the sum back
            self._exchange(flat, rank - power, receive=False)
            flat.copy_(self._exchange(flat, rank - power, send=False))
            return
        if rank + power < n:
            flat.add_(self._exchange(flat, rank + power, send=False))
        lo, hi, spans, distance = 0, flat.numel(), [], power // 2
        while distance:                    # halving: each round, sum half of what is left
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
            flat[keep[0]:keep[1]].add_(self._exchange(flat[give[0]:give[1]], rank ^ distance, keep[1] - keep[0]))
            spans.append((lo, hi))
            lo, hi = keep
            distance //= 2
        distance = 1
        for outer_lo, outer_hi in reversed(spans):     # doubling: the summed parts back
            theirs = (hi, outer_hi) if lo == outer_lo else (outer_lo, lo)
            flat[theirs[0]:theirs[1]].copy_(self._exchange(flat[lo:hi], rank ^ distance, theirs[1] - theirs[0]))
            lo, hi = outer_lo, outer_hi
            distance *= 2
        if rank + power < n:
            self._exchange(flat, rank + power, receive=False)

    def _exchange(self, mine: torch.Tensor, partner: int, size: Optional[int] = None, send: bool = True,
                  receive: bool = True) -> torch.Tensor:
        """``mine`` to ``partner``, and ``size`` values (``mine``'s count unless said) from it,
        each message with its mark; what came (a view of a buffer of its own)."""
        sending = dist.isend(torch.cat([mine, mine.new_full((1,), _SENT)]), partner) if send else None
        if not receive:
            sending.wait()
            return mine
        buffer = mine.new_full(((mine.numel() if size is None else size) + 1,), math.nan)
        try:
            dist.recv(buffer, partner)
            if buffer[-1].item() != _SENT:
                raise GroupFailed(f"member {partner} of the trainers' group failed or left during an all-reduce")
        except BaseException:
            if sending is not None:
                self._keep(sending)      # its receiver may never take it: not waited for
            raise
        if sending is not None:
            sending.wait()
        return buffer[:-1]
