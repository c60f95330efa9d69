"""Each clocked mode's rules: when a trainer's step may begin, what its arrival does, where a new
member's clock starts, and whom a stall waits for. ``SspPace`` lets a trainer run at most ``bound``
steps ahead of the slowest and answers each arrival at once; ``SyncPace`` holds the arrivals of the
open step until every member has arrived, has the servers apply their average, and in lockstep
begins each step for the whole group at once; ``HybridPace`` is sync's lockstep without the
average (each trainer's rows were applied as in async), so it answers arrivals at once. Each
works on its ``StepClock``'s members, under its lock; the actions it returns run after the lock
is let go."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from ps.spec.messages import Applied
from services.errors import BadRequest
from ps.leader.clock.lockstep import Lockstep
from ps.spec.consistency import Consistency, Hybrid, Ssp, Sync

if TYPE_CHECKING:
    from ps.leader.clock.clock import StepClock, _Member, _Waiting

log = logging.getLogger("ps.leader.clock")

STALL_WARNING_SECONDS = 10.0   # a barrier waiting this long names whom it waits for in the log
# sync: a job's first step waits this long at most for the trainers it starts with (one that never
# comes must not hold the others for ever); then it begins with those there.
START_WAIT_SECONDS = 120.0

Actions = list[Callable[[], None]]


@dataclass
class Stall:
    step: int
    on: tuple[str, ...]
    seconds: float


class SspPace:
    waits_at_begin = True      # a trainer's wait is at its begin (sync's is at its arrival)

    def __init__(self, clock: "StepClock", bound: int) -> None:
        self.clock, self.bound = clock, bound

    def lockstep(self) -> bool:
        return False

    def next_step(self, name: str) -> int:
        return self.clock.clock_of(name) + 1

    def furthest_begun(self) -> int:
        return max((m.clock + m.working for m in self.clock.members.values()), default=0)

    def check_ahead(self, ahead: int) -> None:
        if ahead > self.bound:
            raise BadRequest(f"reading {ahead} steps ahead is staler than {self.clock.consistency} allows: "
                             f"prefetch at most {self.bound} steps")

    def may_begin(self, name: str) -> bool:
        # Rows read now for a step ``ahead`` further on must be as fresh as that step's own reads.
        ahead = self.clock.begins[name].ahead
        return self.clock.clock_of(name) + ahead - self.clock.min_clock() <= self.bound

    def start_clock(self, name: str) -> int:
        # Its clock from the checkpoint resumed, but never behind a trainer already stepping: the
        # others would wait for it to catch up.
        others = self.clock.min_clock() if self.clock.members else 0
        return max(self.clock.saved.pop(name, others), others)

    def arrive(self, name: str, member: "_Member", arrival: "_Waiting", broken: bool) -> Actions:
        member.clock += 1
        answer = Applied(member.clock, (name,), math.nan)
        return [lambda: arrival.pending.set_result(answer)]

    def left(self, name: str, member: "_Member") -> None:
        pass

    def settle(self, now: float) -> Actions:
        return []

    def stall(self, now: float) -> Optional[Stall]:
        clock = self.clock
        held = [n for n in clock.begins if n in clock.members and not clock.frozen_out(n)]
        if not held:
            return None
        slowest = clock.min_clock()
        late = tuple(sorted(n for n, m in clock.members.items() if m.clock == slowest))
        return Stall(slowest + 1, late, now - min(clock.begins[n].since for n in held))

    def describe(self) -> dict[str, Any]:
        return {}


class SyncPace:
    waits_at_begin = False

    def __init__(self, clock: "StepClock") -> None:
        self.clock = clock
        self.arrivals: dict[str, "_Waiting"] = {}   # arrived at the open step
        self.applying = False
        self.short = False                          # a member of the open step was dropped
        self.group = Lockstep()
        self._started_short = False                 # the job's start lapsed (warned once)
        # The job has begun: a clock every member left (one waits for data, another died) is not
        # a job's start, and whoever comes back does not wait for the trainers it starts with.
        self._begun = False

    def lockstep(self) -> bool:
        clock = self.clock
        return any(m.lockstep for m in clock.members.values()) or any(w.lockstep for w in clock.begins.values())

    def busy(self) -> bool:
        """The open step has begun: someone works on it, arrived at it, or it is being applied."""
        return self.applying or bool(self.arrivals) or any(m.working for m in self.clock.members.values())

    def next_step(self, name: str) -> int:
        return self.clock.step + 1

    def furthest_begun(self) -> int:
        return self.clock.step + 1 if self.busy() else self.clock.step

    def check_ahead(self, ahead: int) -> None:
        if ahead:
            raise BadRequest("a sync step reads its rows once the step before it is applied: nothing is read ahead")

    def may_begin(self, name: str) -> bool:
        if self.applying:
            return False
        if name in self.clock.members:
            return True
        if not self.clock.members:
            return self._all_in([n for n in self.clock.begins if not self.clock.frozen_out(n)])
        # New to the clock: it may join the open step while nobody has finished it, else the next.
        return not self.arrivals

    def _all_in(self, waiting: list[str]) -> bool:
        """The job's start (no member yet): its first step begins once the trainers it starts with
        all ask for it, so none trains a step alone before the others are in; or once the first
        has waited ``START_WAIT_SECONDS``."""
        clock = self.clock
        expected = max((clock.begins[n].start_with for n in waiting), default=0)
        if self._begun or len(waiting) >= expected:
            self._begun = True
            return True
        if clock.now() - min(clock.begins[n].since for n in waiting) < START_WAIT_SECONDS:
            return False
        if not self._started_short:
            self._started_short = True
            log.warning("step %d begins with %d of the %d trainers the job starts with: the others have not asked "
                        "within %.0fs", clock.step + 1, len(waiting), expected, START_WAIT_SECONDS)
        self._begun = True
        return True

    def _missing(self) -> int:
        """At the job's start: the trainers the first step still waits for."""
        clock = self.clock
        if self._begun or clock.members or not clock.begins:
            return 0
        return max(w.start_with for w in clock.begins.values()) - len(clock.begins)

    def start_clock(self, name: str) -> int:
        return self.clock.step

    def arrive(self, name: str, member: "_Member", arrival: "_Waiting", broken: bool) -> Actions:
        self.arrivals[name] = arrival
        self.short = self.short or arrival.refused
        if broken:
            self.group.broke()
        return []

    def left(self, name: str, member: "_Member") -> None:
        if name not in self.arrivals:
            self.short = self.short or bool(self.arrivals) or member.working

    def settle(self, now: float) -> Actions:
        actions: Actions = []
        if not self.applying and self.arrivals and all(n in self.arrivals for n in self.clock.members):
            actions.append(self._close())
        if self.lockstep():
            actions += self._grant_together(now)
        return actions

    def _grant_together(self, now: float) -> Actions:
        """Lockstep: the next step for every member at once, once all of them (and any newcomer)
        wait to begin it, and the first step once the job's starting count does."""
        clock = self.clock
        if self.busy():
            return []
        ready = sorted(n for n in clock.begins if not clock.frozen_out(n))
        if any(n not in ready for n in clock.members):
            return []
        if not clock.members and (not ready or not self._all_in(ready)):
            return []
        self.group.form(tuple(ready), clock.step + 1)
        return [clock.grant(name, now) for name in ready]

    def _close(self) -> Callable[[], None]:
        """Every member arrived: have the servers apply the step (off the lock)."""
        clock = self.clock
        self.applying = True
        step, arrived = clock.step + 1, dict(self.arrivals)
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
                norm = clock.apply(step, participants, clip, replica_sq) if clock.apply is not None else math.nan
            except Exception as exc:  # noqa: BLE001 - the arrivals get it; the clock goes on
                log.error("step %d could not be applied: %s", step, exc)
                self._closed(step, arrived, exc, participants)
            else:
                self._closed(step, arrived, norm, participants)
        return lambda: clock.run(apply)

    def _closed(self, step: int, arrived: dict[str, "_Waiting"], outcome: Any, participants: list[str]) -> None:
        clock = self.clock
        with clock.lock:
            self.applying = False
            for name in arrived:
                self.arrivals.pop(name, None)
            failed = isinstance(outcome, Exception)
            if not participants:
                step = clock.step
            elif not failed:
                clock.step = step
                for member in clock.members.values():
                    member.clock = step
                if clock.metrics is not None:
                    if self.short:
                        clock.metrics.short_step()
                    now = clock.now()
                    for waiting in arrived.values() if not self.waits_at_begin else ():
                        clock.metrics.observe_wait(now - waiting.since)
            self.short = False
            actions = clock.settle()
        answer = Applied(step, tuple(participants), float(outcome)) if not failed else None
        for waiting in arrived.values():
            if failed:
                actions.append(lambda w=waiting: w.pending.set_exception(outcome))
            else:
                actions.append(lambda w=waiting: w.pending.set_result(answer))
        run(actions)

    def stall(self, now: float) -> Optional[Stall]:
        clock = self.clock
        missing = self._missing()
        if missing > 0 and clock.frozen_at is None:
            first = min(w.since for w in clock.begins.values())
            return Stall(clock.step + 1, (f"{missing} more of the trainers the job starts with",), now - first)
        if self.lockstep() and clock.begins and not self.arrivals and not self.applying and clock.frozen_at is None:
            # Lockstep: the step begins once every member asks to.
            late = tuple(sorted(n for n, m in clock.members.items() if n not in clock.begins and not m.working))
            first = min(w.since for w in clock.begins.values())
            return Stall(clock.step + 1, late, now - first) if late else None
        if not self.arrivals or self.applying:
            return None
        late = tuple(sorted(n for n in clock.members if n not in self.arrivals))
        first = min(w.since for w in self.arrivals.values())
        return Stall(clock.step + 1, late, now - first) if late else None

    def describe(self) -> dict[str, Any]:
        return {"group": self.group.describe()} if self.lockstep() else {}


class HybridPace(SyncPace):
    """Every trainer replicates the dense weights, so every step is in lockstep; its rows' updates
    were each trainer's own, applied before it arrived, so a step closes without one. Nothing of
    the close is news to a trainer, so its arrival is answered at once and it waits only at its
    next begin, which the close lets go for all at once: one wait a step, not two."""

    waits_at_begin = True

    def lockstep(self) -> bool:
        return True

    def arrive(self, name: str, member: "_Member", arrival: "_Waiting", broken: bool) -> Actions:
        answer, pending = Applied(self.clock.step + 1, (name,), math.nan), arrival.pending
        actions = super().arrive(name, member, replace(arrival, pending=_Answered()), broken)
        return actions + [lambda: pending.set_result(answer)]

    def _close(self) -> Callable[[], None]:
        self.applying = True
        step, arrived = self.clock.step + 1, dict(self.arrivals)
        participants = sorted(n for n, w in arrived.items() if not w.refused)
        # A step all of whose trainers were refused is still a step of the replicas (their dense
        # average was applied alike): the clock counts it, so the replicas' step stays the group's.
        return lambda: self._closed(step, arrived, math.nan, participants or sorted(arrived))


class _Answered:
    """Where an arrival answered already is answered again when its step closes: nowhere."""

    def set_result(self, result: Any) -> None:
        pass

    def set_exception(self, exc: BaseException) -> None:
        pass


PACES: dict[type, Callable[..., Any]] = {Sync: lambda clock, mode: SyncPace(clock),
                                         Hybrid: lambda clock, mode: HybridPace(clock),
                                         Ssp: lambda clock, mode: SspPace(clock, mode.bound)}


def pace_for(clock: "StepClock", mode: Consistency) -> "SspPace | SyncPace | HybridPace":
    make = PACES.get(type(mode))
    if make is None:
        raise ValueError(f"{mode} needs no step clock")
    return make(clock, mode)


def run(actions: Actions) -> None:
    for action in actions:
        action()
