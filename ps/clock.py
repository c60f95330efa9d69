"""The step clock: how trainers keep in step in the sync and ssp modes. The leader (ps0) keeps it.

A trainer asks ``begin`` before it reads parameters for a step, and is answered the step's number
when its mode allows; it reports ``arrive`` once its part of the step is done.

* **sync**: the trainers taking part in the open step are the clock's members. When every member
  has arrived (each after handing its gradients to every server), the step closes: the clock has
  the servers apply the average of the arrived trainers' gradients (``apply``), and only then
  answers the arrivals and grants the next ``begin``s. A trainer new to the clock joins the open
  step if nobody has arrived at it yet, else it takes part from the next.
  Trainers that replicate weights among themselves (``--dense allreduce``) step in **lockstep**:
  their all-reduce needs the same group of trainers in every step of it, so a step begins for all
  its members at once, once each has asked to begin it (and, for the first step, once the job's
  starting count of trainers asks). The members of a step are its *group*; a new group (a trainer
  died, left or joined, or a member found the group broken) has a new ``group_key``, under which
  its members form a new process group before the step (``trainer/core/replica.py``).
* **ssp:K**: an update is the trainer's own, applied before it arrives; ``begin`` of a trainer's
  step t waits while the slowest member has not finished step t-K-1.

A member that dies (membership's probe removes it: ``drop``) or leaves (its episode ended) stops
being waited for at once. In sync mode the step it held up closes with the gradients that arrived:
a trainer's gradients count when it arrived, so they are on every server; a dead trainer's partial
hand-over is discarded, and the average is over the trainers whose gradients it holds.

A checkpoint ``freeze``s the clock at the furthest step any member has begun: members finish up to
it and wait at their next ``begin``, where they are ``parked`` (nobody waits on anybody else then,
so the pause cannot deadlock a barrier). ``thaw`` lets them go on.

``StepClock`` is the logic, without RPC or threads of its own; ``StepClockService`` is its RPC
surface on the leader.
"""
from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from ps.consistency import Consistency
from services.errors import BadRequest, NotReady
from services.remote import Service, remote

log = logging.getLogger(__name__)

STALL_WARNING_SECONDS = 10.0   # a barrier waiting this long names whom it waits for in the log
FREEZE_SECONDS = 120.0         # a checkpoint's freeze outlives its pause by far; a lost thaw ends with it


class Pending(Protocol):
    """An answer to come (``torch.futures.Future`` over RPC; any object with these in tests)."""

    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exc: BaseException) -> None: ...


class ClockMetrics(Protocol):
    def observe_wait(self, seconds: float) -> None: ...
    def short_step(self) -> None: ...


@dataclass(frozen=True)
class Applied:
    """``arrive``'s answer: the step is applied (sync: on every server; ssp: the trainer's own)."""

    step: int                        # the trainer's clock after this step
    participants: tuple[str, ...]    # sync: whose gradients the update averaged
    grad_norm: float                 # sync: of the averaged gradient, before clipping (nan otherwise)


@dataclass(frozen=True)
class Granted:
    """``begin``'s answer: the step the trainer may begin now, and in lockstep its group."""

    step: int
    group: tuple[str, ...] = ()      # lockstep: the trainers taking this step, in rank order
    group_key: str = ""              # lockstep: the same for every step of one group, new with each group


@dataclass
class _Member:
    clock: int                  # steps it has completed under this clock
    working: bool = False       # began a step and has not arrived
    lockstep: int = 0           # the trainers its job starts with when it steps in lockstep (0: it does not)


@dataclass
class _Waiting:
    pending: Pending
    since: float
    clip: float = 0.0
    refused: bool = False     # sync: the servers refused its gradients; the step goes on without them
    replica_sq: float = 0.0   # sync: squared norm of the averaged gradient of weights the trainers replicate
    lockstep: int = 0         # begin: as ``_Member.lockstep``


@dataclass
class _Stall:
    step: int
    on: tuple[str, ...]
    seconds: float


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
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._begins: dict[str, _Waiting] = {}      # waiting for a step to begin
        self._arrivals: dict[str, _Waiting] = {}    # sync: arrived at the open step
        self._parkers: list[tuple[str, Pending]] = []
        self._applying = False
        self._short = False                         # sync: a member of the open step was dropped
        self._freezes: dict[str, float] = {}        # holder -> when its freeze lapses
        self._frozen_at: Optional[int] = None       # no member begins a step after this one
        self._frozen_members: set[str] = set()
        self._warned: Optional[tuple[int, tuple[str, ...], float]] = None
        # Lockstep: the group of the last step begun, and its key. The key's prefix is this clock's
        # own, so a group of a restarted leader never meets keys an older one left in the store.
        self._group: tuple[str, ...] = ()
        self._generation = 0
        self._incarnation = secrets.token_hex(4)
        self._regroup = False                       # a member found the group broken

    def advance_to(self, step: int) -> None:
        """sync: the servers count on from ``step`` (a server joined further on than the leader)."""
        with self._lock:
            self.step = max(self.step, step)

    # --- a trainer's calls ---------------------------------------------------------------------------
    def begin(self, name: str, pending: Pending, lockstep: int = 0) -> None:
        """``lockstep``: the trainer replicates weights with the others, and the job starts with
        this many trainers (sync only; 0: it does not)."""
        with self._lock:
            member = self._members.get(name)
            if member is not None and member.working:
                raise BadRequest(f"{name} began a step it has not arrived from")
            if name in self._begins:
                raise BadRequest(f"{name} is already waiting to begin a step")
            if lockstep and self.consistency.kind != "sync":
                raise BadRequest(f"lockstep steps need the sync mode; the servers run {self.consistency}")
            others = [(n, m.lockstep) for n, m in self._members.items() if n != name] + \
                     [(n, w.lockstep) for n, w in self._begins.items()]
            mixed = [n for n, other in others if bool(other) != bool(lockstep)]
            if mixed:
                raise BadRequest(f"{name} {'replicates' if lockstep else 'does not replicate'} dense weights and "
                                 f"{mixed[0]} {'does not' if lockstep else 'does'}: every trainer of a job needs the "
                                 f"same --dense")
            self._begins[name] = _Waiting(pending, self.now(), lockstep=lockstep)
            actions = self._settle()
        _run(actions)

    def arrive(self, name: str, clip: float, pending: Pending, refused: bool = False, replica_sq: float = 0.0,
               broken: bool = False) -> None:
        """``refused``: its update was refused (sync: it is no participant of the step).
        ``replica_sq``: the squared norm of the step's averaged gradient of the weights trainers
        replicate (``--dense allreduce``), which the global norm clipped includes. ``broken``: its
        step failed in the group's all-reduce, so the next step needs a new group."""
        with self._lock:
            member = self._members.get(name)
            if member is None or not member.working:
                raise BadRequest(f"{name} arrived without beginning a step")
            member.working = False
            if self.consistency.kind == "sync":
                self._arrivals[name] = _Waiting(pending, self.now(), clip, refused, replica_sq)
                self._short = self._short or refused
                self._regroup = self._regroup or broken
                actions = self._settle()
            else:
                member.clock += 1
                answer = Applied(member.clock, (name,), math.nan)
                actions = [lambda: pending.set_result(answer)] + self._settle()
        _run(actions)

    def leave(self, name: str, why: str = "left") -> None:
        """``name`` takes no more steps (its episode ended, it stopped, or it died)."""
        with self._lock:
            member = self._members.pop(name, None)
            waiting = self._begins.pop(name, None)
            if member is not None and self.consistency.kind == "sync" and name not in self._arrivals:
                self._short = self._short or bool(self._arrivals) or member.working
            actions = self._settle()
        if waiting is not None:
            actions.append(lambda: waiting.pending.set_exception(NotReady(f"{name} left the step clock")))
        if member is not None or waiting is not None:
            log.info("%s %s the step clock%s", name, why, f" at step {member.clock}" if member else "")
        _run(actions)

    def drop(self, name: str) -> None:
        """Membership removed ``name`` (dead, or gone without leaving)."""
        self.leave(name, "was dropped from")

    # --- a checkpoint's calls ------------------------------------------------------------------------
    def freeze(self, holder: str, seconds: float = FREEZE_SECONDS) -> None:
        with self._lock:
            if self._frozen_at is None:
                self._frozen_at = self._furthest_begun()
                self._frozen_members = set(self._members)
            self._freezes[holder] = self.now() + seconds
            actions = self._settle()
        _run(actions)

    def thaw(self, holder: str) -> None:
        with self._lock:
            self._freezes.pop(holder, None)
            actions = self._settle()
        _run(actions)

    def parked(self, name: str, pending: Pending) -> None:
        """Answer True once ``name`` waits at a ``begin`` the freeze holds (or takes no steps)."""
        with self._lock:
            self._parkers.append((name, pending))
            actions = self._settle()
        _run(actions)

    # --- what others read ----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        with self._lock:
            stall = self._stall()
            return {"consistency": str(self.consistency), "step": self.step,
                    "clocks": {n: m.clock for n, m in sorted(self._members.items())},
                    "waiting": None if stall is None else {"step": stall.step, "on": list(stall.on),
                                                           "seconds": round(stall.seconds, 3)},
                    "frozen_at": self._frozen_at,
                    **({"group": {"generation": self._generation, "members": list(self._group)}}
                       if self._lockstep() else {})}

    def clocks(self) -> dict[str, int]:
        with self._lock:
            return {n: m.clock for n, m in self._members.items()}

    def tick(self) -> Optional[_Stall]:
        """Periodically: lapse forgotten freezes; the stall to warn of, once per 10 s of it."""
        with self._lock:
            actions = self._settle()
            stall = self._stall()
            warn = None
            if stall is not None and stall.seconds >= STALL_WARNING_SECONDS:
                key = (stall.step, stall.on)
                if self._warned is None or self._warned[:2] != key or self.now() - self._warned[2] >= STALL_WARNING_SECONDS:
                    self._warned = (*key, self.now())
                    warn = stall
        _run(actions)
        if warn is not None:
            log.warning("step %d has waited %.0fs for %s", warn.step, warn.seconds, ", ".join(warn.on))
        return warn

    # --- the rules -------------------------------------------------------------------------------------
    def _furthest_begun(self) -> int:
        if self.consistency.kind == "sync":
            busy = self._applying or self._arrivals or any(m.working for m in self._members.values())
            return self.step + 1 if busy else self.step
        return max((m.clock + m.working for m in self._members.values()), default=0)

    def _lockstep(self) -> bool:
        return any(m.lockstep for m in self._members.values()) or any(w.lockstep for w in self._begins.values())

    def _min_clock(self) -> int:
        return min((m.clock for m in self._members.values()), default=0)

    def _clock_of(self, name: str) -> int:
        """``name``'s completed steps; a trainer new to the clock starts at the slowest member's."""
        member = self._members.get(name)
        return member.clock if member is not None else self._min_clock()

    def _next_step(self, name: str) -> int:
        return self.step + 1 if self.consistency.kind == "sync" else self._clock_of(name) + 1

    def _frozen_out(self, name: str) -> bool:
        if self._frozen_at is None:
            return False
        return name not in self._frozen_members or self._next_step(name) > self._frozen_at

    def _may_begin(self, name: str) -> bool:
        if self._frozen_out(name):
            return False
        if self.consistency.kind == "sync":
            if self._applying:
                return False
            if name in self._members:
                return True
            # New to the clock: it may join the open step while nobody has finished it, else the next.
            return not self._arrivals
        return self._clock_of(name) - self._min_clock() <= (self.consistency.bound or 0)

    def _settle(self) -> list[Callable[[], None]]:
        """After any change (under the lock): what can go on now, as actions to run after it."""
        actions: list[Callable[[], None]] = []
        now = self.now()
        for holder in [h for h, until in self._freezes.items() if until <= now]:
            log.warning("the checkpoint freeze by %s lapsed without a thaw", holder)
            del self._freezes[holder]
        if not self._freezes and self._frozen_at is not None:
            self._frozen_at, self._frozen_members = None, set()
        if self.consistency.kind == "sync" and not self._applying and self._arrivals \
                and all(n in self._arrivals for n in self._members):
            actions.append(self._close())
        if self.consistency.kind == "sync" and self._lockstep():
            actions += self._grant_together(now)
        progressed = True
        while progressed and not self._lockstep():   # a grant can raise the slowest clock's peers' bound
            progressed = False
            for name in list(self._begins):
                if self._may_begin(name):
                    actions.append(self._grant(name, now))
                    progressed = True
        for name, pending in list(self._parkers):
            parked = name not in self._members or (name in self._begins and self._frozen_out(name))
            if parked or self._frozen_at is None:     # thawed before it parked: not held
                self._parkers.remove((name, pending))
                actions.append(lambda p=pending, held=parked: p.set_result(held))
        return actions

    def _grant_together(self, now: float) -> list[Callable[[], None]]:
        """Lockstep: the next step for every member at once, once all of them (and any newcomer)
        wait to begin it, and the first step once the job's starting count does."""
        if self._applying or self._arrivals or any(m.working for m in self._members.values()):
            return []
        ready = sorted(n for n in self._begins if not self._frozen_out(n))
        if any(n not in ready for n in self._members):
            return []
        if not self._members and len(ready) < max((self._begins[n].lockstep for n in ready), default=1):
            return []
        group = tuple(ready)
        if group != self._group or self._regroup:
            self._group, self._regroup = group, False
            self._generation += 1
            log.info("lockstep group %d from step %d: %s", self._generation, self.step + 1, ", ".join(group))
        return [self._grant(name, now) for name in group]

    def _grant(self, name: str, now: float) -> Callable[[], None]:
        waiting = self._begins.pop(name)
        member = self._members.get(name)
        if member is None:
            if self.consistency.kind == "sync":
                start = self.step
            else:
                # Its clock from the checkpoint resumed, but never behind a trainer already stepping:
                # the others would wait for it to catch up.
                others = self._min_clock() if self._members else 0
                start = max(self.saved.pop(name, others), others)
            member = self._members[name] = _Member(start, lockstep=waiting.lockstep)
        member.working = True
        if self.metrics is not None and self.consistency.kind == "ssp":   # sync waits at its arrivals
            self.metrics.observe_wait(now - waiting.since)
        granted = Granted(member.clock + 1, self._group, f"{self._incarnation}/{self._generation}") \
            if member.lockstep else Granted(member.clock + 1)
        return lambda: waiting.pending.set_result(granted)

    def _close(self) -> Callable[[], None]:
        """sync: every member arrived; have the servers apply the step (off the lock)."""
        self._applying = True
        step, arrived = self.step + 1, dict(self._arrivals)
        participants = sorted(n for n, w in arrived.items() if not w.refused)
        if not participants:      # every update of the step was refused: nothing to apply, same step again
            return lambda: self._closed(step, arrived, math.nan, participants)
        clips = {arrived[n].clip for n in participants}
        if len(clips) > 1:
            log.warning("trainers asked to clip step %d at different norms %s; using the smallest", step, sorted(clips))
        clip = min(clips)
        # The trainers all-reduced their replicas' gradients, so each reports the same norm.
        replica_sq = max(arrived[n].replica_sq for n in participants)

        def apply() -> None:
            try:
                norm = self.apply(step, participants, clip, replica_sq) if self.apply is not None else math.nan
            except Exception as exc:  # noqa: BLE001 - the arrivals get it; the clock goes on
                log.error("step %d could not be applied: %s", step, exc)
                self._closed(step, arrived, exc, participants)
            else:
                self._closed(step, arrived, norm, participants)
        return lambda: self.run(apply)

    def _closed(self, step: int, arrived: dict[str, _Waiting], outcome: Any, participants: list[str]) -> None:
        with self._lock:
            self._applying = False
            for name in arrived:
                self._arrivals.pop(name, None)
            failed = isinstance(outcome, Exception)
            if not participants:
                step = self.step
            elif not failed:
                self.step = step
                for member in self._members.values():
                    member.clock = step
                if self.metrics is not None:
                    if self._short:
                        self.metrics.short_step()
                    now = self.now()
                    for waiting in arrived.values():
                        self.metrics.observe_wait(now - waiting.since)
            self._short = False
            actions = self._settle()
        answer = Applied(step, tuple(participants), float(outcome)) if not failed else None
        for waiting in arrived.values():
            if failed:
                actions.append(lambda w=waiting: w.pending.set_exception(outcome))
            else:
                actions.append(lambda w=waiting: w.pending.set_result(answer))
        _run(actions)

    def _stall(self) -> Optional[_Stall]:
        """Whom the clock waits for, and since when (under the lock)."""
        now = self.now()
        if self.consistency.kind == "sync":
            if self._lockstep() and self._begins and not self._arrivals and not self._applying \
                    and self._frozen_at is None:
                # Lockstep: the step begins once every member asks to.
                late = tuple(sorted(n for n, m in self._members.items() if n not in self._begins and not m.working))
                first = min(w.since for w in self._begins.values())
                return _Stall(self.step + 1, late, now - first) if late else None
            if not self._arrivals or self._applying:
                return None
            late = tuple(sorted(n for n in self._members if n not in self._arrivals))
            first = min(w.since for w in self._arrivals.values())
            return _Stall(self.step + 1, late, now - first) if late else None
        held = [n for n in self._begins if n in self._members and not self._frozen_out(n)]
        if not held:
            return None
        slowest = self._min_clock()
        late = tuple(sorted(n for n, m in self._members.items() if m.clock == slowest))
        return _Stall(slowest + 1, late, now - min(self._begins[n].since for n in held))


def _run(actions: list[Callable[[], None]]) -> None:
    for action in actions:
        action()


class StepClockService(Service):
    """The step clock's RPC surface on the leader. Trainers reach it through ``ps/stub.py``; the
    caller's RPC name is the trainer's name."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self._caller = threading.local()

    def before_call(self, caller: str, method: str) -> None:
        self._caller.name = caller

    @remote
    def status(self) -> dict:
        """What ps0's /status shows of the clock."""
        return self.clock.describe()

    @remote(asynchronous=True)
    def begin(self, lockstep: int = 0) -> torch.futures.Future:
        """``Granted`` the caller's next step, once it may begin it."""
        if not isinstance(lockstep, int) or isinstance(lockstep, bool) or lockstep < 0:
            raise BadRequest(f"lockstep must be an int >= 0, got {lockstep!r}")
        return self._pending(lambda f: self.clock.begin(self._caller.name, f, lockstep))

    @remote(asynchronous=True)
    def arrive(self, clip: float, refused: bool = False, replica_sq: float = 0.0,
               broken: bool = False) -> torch.futures.Future:
        """The caller's step is done (sync: its gradients are on every server, or ``refused`` by one);
        ``Applied`` once applied."""
        if not (clip >= 0 and math.isfinite(clip)):
            raise BadRequest(f"clip must be a finite float >= 0, got {clip!r}")
        if not (replica_sq >= 0 and math.isfinite(replica_sq)):
            raise BadRequest(f"replica_sq must be a finite float >= 0, got {replica_sq!r}")
        return self._pending(lambda f: self.clock.arrive(self._caller.name, clip, f, bool(refused), replica_sq,
                                                         bool(broken)))

    @remote
    def leave(self) -> None:
        self.clock.leave(self._caller.name)

    @remote
    def freeze(self, seconds: float) -> None:
        if not (0 < seconds <= 3600):
            raise BadRequest(f"seconds must be in (0, 3600], got {seconds!r}")
        self.clock.freeze(self._caller.name, seconds)

    @remote
    def thaw(self) -> None:
        self.clock.thaw(self._caller.name)

    @remote(asynchronous=True)
    def parked(self) -> torch.futures.Future:
        return self._pending(lambda f: self.clock.parked(self._caller.name, f))

    @staticmethod
    def _pending(start: Callable[[torch.futures.Future], None]) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        start(future)
        return future


def applier(max_workers: int = 1) -> Callable[[Callable[[], None]], None]:
    """Where the leader's clock runs a sync step's apply: off the RPC thread that closed it."""
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sync-apply")

    def run(fn: Callable[[], None]) -> None:
        pool.submit(fn)
    return run
