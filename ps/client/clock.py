"""A trainer's side of the leader's step clock (``ps/leader/clock/``), in sync and ssp modes: at
each step boundary ``begin`` waits until the clock lets this trainer begin its next step, a step
ends with ``arrive`` (sync: answered once the step is applied everywhere) or ``lose_step``, and
``end`` leaves the clock when the trainer takes no more steps for now. In async mode every call
returns at once. ``ClockPause`` holds the trainer at the clock for a checkpoint."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ps.spec.consistency import Consistency
from ps.spec.messages import FREEZE_SECONDS, Applied, Granted
from ps.spec.surface import ClockSurface
from services.errors import StepLost
from services.remote import call_async, wait

if TYPE_CHECKING:
    from ps.client.step_end import Replica

# One method of one server, its answer on its way (``PsClient.ask``: planned with its layout).
Ask = Callable[..., "torch.futures.Future[Any]"]

log = logging.getLogger(__name__)


class StepClock:
    """A trainer's steps as the leader's clock counts them: asked of ``leader`` with ``ask``, as
    ``consistency`` says (async: never)."""

    def __init__(self, ask: Ask, leader: str, consistency: Consistency) -> None:
        self._ask, self._leader, self._consistency = ask, leader, consistency
        self.granted: Optional[Granted] = None   # the step under way, as the clock granted it
        self.start_with = 0           # sync: the trainers the job starts with, whom its first step waits for
        self.lockstep = False         # sync: weights replicated among the trainers: steps begin in lockstep
        self.ahead = 0                # ssp: steps further on whose rows each step reads (a prefetch, a cache)

    @property
    def clocked(self) -> bool:
        return self._consistency.clocked

    def begin(self) -> float:
        """At a step boundary: wait until the job's consistency lets this trainer begin its next
        step (async: at once; no wait either when it has begun that step already). The seconds it
        waited."""
        if not self.clocked or self.granted is not None:
            return 0.0
        started = time.perf_counter()
        self.granted = wait(self._ask(self._leader, ClockSurface.begin, self.start_with, self.ahead, self.lockstep,
                                      waits=True))
        return time.perf_counter() - started

    def arrive(self, clip: float, refused: bool = False, replica_sq: float = 0.0,
               broken: bool = False) -> tuple[Applied, float]:
        """Report the step begun to the step clock; its answer (sync: once the step is applied
        everywhere) and when it was reported (``time.monotonic()``)."""
        arrived_at = time.monotonic()
        try:
            applied: Applied = wait(self._ask(self._leader, ClockSurface.arrive, float(clip), refused,
                                               float(replica_sq), broken, waits=True))
        finally:
            self.granted = None      # reported, even if its step then failed: the clock knows
        return applied, arrived_at

    def lose_step(self, why: BaseException, replica: Optional["Replica"] = None) -> StepLost:
        """The step begun failed before it could hand its gradients over. In sync and ssp modes
        the clock is told, so nobody waits for this trainer's part of it. With a ``replica``, the
        failure was in (or may have left) the trainers' group: this trainer leaves it at once, so
        no peer waits on it there, and the clock forms a new one. The error for the caller to raise."""
        if replica is not None:
            replica.leave_group()
        if self.clocked and self.granted is not None:
            try:
                self.arrive(0.0, refused=True, broken=replica is not None)
            except Exception as exc:  # noqa: BLE001 - the leader is gone too: the next begin says so
                log.warning("could not tell the step clock this step is lost: %s", str(exc).splitlines()[0])
        self.granted = None
        return StepLost(f"this step was lost, nothing of it applied: {str(why).splitlines()[0]}")

    def end(self) -> None:
        """This trainer takes no more steps for now (its episode ended): nobody waits for it."""
        if self.clocked:
            self.granted = None
            wait(self._ask(self._leader, ClockSurface.leave))


class ClockPause:
    """A checkpoint's hold on a trainer in sync and ssp modes, at the step clock: the clock stops
    at the furthest step begun, so trainers inside a barrier finish it, and the hold is there once
    this trainer waits at its next ``begin``. (A trainer's own step boundary would deadlock: the
    others in its barrier could never arrive.) ``hold``/``release`` as ``services.control.StepPause``."""

    def __init__(self, ask: Ask, leader: str) -> None:
        self._ask, self._leader = ask, leader

    def hold(self, timeout: float) -> bool:
        wait(self._ask(self._leader, ClockSurface.freeze, FREEZE_SECONDS))
        try:
            return bool(wait(call_async(self._leader, ClockSurface.parked, timeout=timeout)))
        except Exception as exc:  # noqa: BLE001 - not held: say so, and let the others go on
            log.warning("not held at the step clock within %.0fs: %s", timeout, str(exc).splitlines()[0])
            wait(self._ask(self._leader, ClockSurface.thaw))
            return False

    def release(self) -> None:
        wait(self._ask(self._leader, ClockSurface.thaw))
