"""The step clock's RPC surface on the leader, and where a sync step's apply runs."""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ps.leader.clock.clock import StepClock
from ps.spec.surface import ClockSurface
from services.errors import BadRequest
from services.remote import remote

class StepClockService(ClockSurface):
    """The step clock served on the leader (its surface: ``ClockSurface``). Trainers reach it through
    ``ps/client/clock.py``; the caller's RPC name is the trainer's name."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self._caller = threading.local()

    def before_call(self, caller: str, method: str, version: int = 0) -> None:
        self._caller.name = caller

    @remote
    def status(self) -> dict:
        """What ps0's /status shows of the clock."""
        return self.clock.describe()

    @remote(asynchronous=True)
    def begin(self, start_with: int = 0, ahead: int = 0, lockstep: bool = False) -> torch.futures.Future:
        """``Granted`` the caller's next step, once it may begin it."""
        for what, value in (("start_with", start_with), ("ahead", ahead)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadRequest(f"{what} must be an int >= 0, got {value!r}")
        if not isinstance(lockstep, bool):
            raise BadRequest(f"lockstep must be a bool, got {lockstep!r}")
        return self._pending(lambda f: self.clock.begin(self._caller.name, f, start_with, ahead, lockstep))

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
