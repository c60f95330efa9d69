"""``StepClock``: the clock's members, who waits to begin a step, and the calls trainers and
checkpoints make of it. The rules of its mode are its ``pace`` (``pace.py``); a checkpoint's hold
is its ``freeze`` (``freeze.py``). No RPC here, no threads of its own: the package's docstring
tells the whole story, ``service.py`` serves it."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from ps.leader.clock.freeze import Freeze, Pending
from ps.leader.clock.pace import STALL_WARNING_SECONDS, Actions, Stall, pace_for, run
from ps.spec.consistency import Consistency
from ps.spec.messages import FREEZE_SECONDS, Granted
from services.errors import BadRequest, NotReady

log = logging.getLogger("ps.leader.clock")

__all__ = ["StepClock"]


class ClockMetrics(Protocol):
    def observe_wait(self, seconds: float) -> None: ...
    def short_step(self) -> None: ...


@dataclass
class _Member:
    clock: int                  # steps it has completed under this clock
    working: bool = False       # began a step and has not arrived
    lockstep: bool = False      # it replicates weights with the others, so steps begin for all at once


@dataclass
class _Waiting:
    pending: Pending
    since: float
    clip: float = 0.0
    refused: bool = False     # sync: the servers refused its gradients; the step goes on without them
    replica_sq: float = 0.0   # sync: squared norm of the averaged gradient of weights the trainers replicate
    lockstep: bool = False    # begin: as ``_Member.lockstep``
    ahead: int = 0            # begin, ssp: the steps further on whose rows it reads during this one
    start_with: int = 0       # begin, sync: the trainers its job starts with (0: it does not say)


@dataclass
class StepClock:
    consistency: Consistency
    # sync: (step, trainers, clip, replicated weights' squared gradient norm) -> the global norm
    apply: Optional[Callable[[int, list[str], float, float], float]] = None
    run: Callable[[Callable[[], None]], None] = lambda fn: fn()          # where ``apply`` runs
    metrics: Optional[ClockMetrics] = None
    now: Callable[[], float] = time.monotonic
    step: int = 0                     # sync: steps applied, the servers' step
    saved: dict[str, int] = field(default_factory=dict)   # ssp: clocks from the checkpoint resumed

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.members: dict[str, _Member] = {}
        self.begins: dict[str, _Waiting] = {}      # waiting for a step to begin
        self.pace = pace_for(self, self.consistency)
        self.freeze_ = Freeze()
        self._warned: Optional[tuple[int, tuple[str, ...], float]] = None

    def advance_to(self, step: int) -> None:
        """sync: the servers count on from ``step`` (a server joined further on than the leader)."""
        with self.lock:
            self.step = max(self.step, step)

    # --- a trainer's calls ---------------------------------------------------------------------------
    def begin(self, name: str, pending: Pending, start_with: int = 0, ahead: int = 0, lockstep: bool = False) -> None:
        """``start_with``: the trainers its job starts with (sync: the job's first step waits for
        them). ``ahead``: the steps further on whose rows it reads during this one (a prefetch),
        which the pace counts as steps ahead. ``lockstep``: the trainer replicates weights with the
        others (sync, hybrid)."""
        with self.lock:
            member = self.members.get(name)
            if member is not None and member.working:
                raise BadRequest(f"{name} began a step it has not arrived from")
            if name in self.begins:
                raise BadRequest(f"{name} is already waiting to begin a step")
            try:
                self.consistency.check_dense("allreduce" if lockstep else "ps")
            except ValueError as exc:
                raise BadRequest(f"{name} cannot step here: {exc}") from None
            others = [(n, m.lockstep) for n, m in self.members.items() if n != name] + \
                     [(n, w.lockstep) for n, w in self.begins.items()]
            mixed = [n for n, other in others if other != lockstep]
            if mixed:
                raise BadRequest(f"{name} {'replicates' if lockstep else 'does not replicate'} dense weights and "
                                 f"{mixed[0]} {'does not' if lockstep else 'does'}: every trainer of a job needs the "
                                 f"same --dense")
            self.pace.check_ahead(ahead)
            self.begins[name] = _Waiting(pending, self.now(), lockstep=lockstep, ahead=ahead, start_with=start_with)
            actions = self.settle()
        run(actions)

    def arrive(self, name: str, clip: float, pending: Pending, refused: bool = False, replica_sq: float = 0.0,
               broken: bool = False) -> None:
        """``refused``: its update was refused (sync: it is no participant of the step).
        ``replica_sq``: the squared norm of the step's averaged gradient of the weights trainers
        replicate (``--dense allreduce``), which the global norm clipped includes. ``broken``: its
        step failed in the group's all-reduce, so the next step needs a new group."""
        with self.lock:
            member = self.members.get(name)
            if member is None or not member.working:
                raise BadRequest(f"{name} arrived without beginning a step")
            member.working = False
            actions = self.pace.arrive(name, member, _Waiting(pending, self.now(), clip, refused, replica_sq), broken)
            actions += self.settle()
        run(actions)

    def leave(self, name: str, why: str = "left") -> None:
        """``name`` takes no more steps (its episode ended, it stopped, or it died)."""
        with self.lock:
            member = self.members.pop(name, None)
            waiting = self.begins.pop(name, None)
            if member is not None:
                self.pace.left(name, member)
            actions = self.settle()
        if waiting is not None:
            actions.append(lambda: waiting.pending.set_exception(NotReady(f"{name} left the step clock")))
        if member is not None or waiting is not None:
            log.info("%s %s the step clock%s", name, why, f" at step {member.clock}" if member else "")
        run(actions)

    def drop(self, name: str) -> None:
        """Membership removed ``name`` (dead, or gone without leaving)."""
        self.leave(name, "was dropped from")

    # --- a checkpoint's calls ------------------------------------------------------------------------
    def freeze(self, holder: str, seconds: float = FREEZE_SECONDS) -> None:
        with self.lock:
            self.freeze_.hold(holder, self.now() + seconds, self.pace.furthest_begun, self.members)
            actions = self.settle()
        run(actions)

    def thaw(self, holder: str) -> None:
        with self.lock:
            self.freeze_.release(holder)
            actions = self.settle()
        run(actions)

    def parked(self, name: str, pending: Pending) -> None:
        """Answer True once ``name`` waits at a ``begin`` the freeze holds (or takes no steps)."""
        with self.lock:
            self.freeze_.park(name, pending)
            actions = self.settle()
        run(actions)

    # --- what others read ----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        with self.lock:
            stall = self.pace.stall(self.now())
            return {"consistency": str(self.consistency), "step": self.step,
                    "clocks": {n: m.clock for n, m in sorted(self.members.items())},
                    "waiting": None if stall is None else {"step": stall.step, "on": list(stall.on),
                                                           "seconds": round(stall.seconds, 3)},
                    "frozen_at": self.frozen_at, **self.pace.describe()}

    def clocks(self) -> dict[str, int]:
        with self.lock:
            return {n: m.clock for n, m in self.members.items()}

    def tick(self) -> Optional[Stall]:
        """Periodically: lapse forgotten freezes; the stall to warn of, once per 10 s of it."""
        with self.lock:
            actions = self.settle()
            stall = self.pace.stall(self.now())
            warn = None
            if stall is not None and stall.seconds >= STALL_WARNING_SECONDS:
                key = (stall.step, stall.on)
                if self._warned is None or self._warned[:2] != key or self.now() - self._warned[2] >= STALL_WARNING_SECONDS:
                    self._warned = (*key, self.now())
                    warn = stall
        run(actions)
        if warn is not None:
            log.warning("step %d has waited %.0fs for %s", warn.step, warn.seconds, ", ".join(warn.on))
        return warn

    # --- for the pace (under the lock) -------------------------------------------------------------------
    @property
    def frozen_at(self) -> Optional[int]:
        return self.freeze_.at

    def min_clock(self) -> int:
        return min((m.clock for m in self.members.values()), default=0)

    def clock_of(self, name: str) -> int:
        """``name``'s completed steps; a trainer new to the clock starts at the slowest member's."""
        member = self.members.get(name)
        return member.clock if member is not None else self.min_clock()

    def frozen_out(self, name: str) -> bool:
        return self.freeze_.holds(name, self.pace.next_step(name))

    def settle(self) -> Actions:
        """After any change: what can go on now, as actions to run after the lock is let go."""
        now = self.now()
        self.freeze_.lapse(now)
        actions = self.pace.settle(now)
        progressed = True
        while progressed and not self.pace.lockstep():   # a grant can raise the slowest clock's peers' bound
            progressed = False
            for name in list(self.begins):
                if not self.frozen_out(name) and self.pace.may_begin(name):
                    actions.append(self.grant(name, now))
                    progressed = True
        return actions + self.freeze_.answer_parkers(
            lambda name: name not in self.members or (name in self.begins and self.frozen_out(name)))

    def grant(self, name: str, now: float) -> Callable[[], None]:
        waiting = self.begins.pop(name)
        member = self.members.get(name)
        if member is None:
            member = self.members[name] = _Member(self.pace.start_clock(name), lockstep=waiting.lockstep)
        member.working = True
        if self.metrics is not None and self.pace.waits_at_begin:
            self.metrics.observe_wait(now - waiting.since)
        group = self.pace.group if member.lockstep else None       # only sync's pace steps in lockstep
        granted = Granted(member.clock + 1, group.members, group.key) if group is not None else Granted(member.clock + 1)
        return lambda: waiting.pending.set_result(granted)
