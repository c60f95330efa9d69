"""A checkpoint's hold on the step clock: ``hold`` stops it at the furthest step begun; members
finish up to there and are ``parked`` at their next ``begin``; the hold ends when every holder
``release``s it, or when a holder's lease lapses (a checkpoint that died without thawing)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Protocol

log = logging.getLogger("ps.leader.clock")



class Pending(Protocol):
    """An answer to come (``torch.futures.Future`` over RPC; any object with these in tests)."""

    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exc: BaseException) -> None: ...


class Freeze:
    def __init__(self) -> None:
        self._holders: dict[str, float] = {}          # holder -> when its hold lapses
        self.at: Optional[int] = None                 # no member begins a step after this one
        self._members: set[str] = set()               # the members when it froze; newcomers wait
        self._parkers: list[tuple[str, Pending]] = []

    def hold(self, holder: str, until: float, furthest_begun: Callable[[], int], members: Iterable[str]) -> None:
        if self.at is None:
            self.at, self._members = furthest_begun(), set(members)
        self._holders[holder] = until

    def release(self, holder: str) -> None:
        self._holders.pop(holder, None)

    def lapse(self, now: float) -> None:
        for holder in [h for h, until in self._holders.items() if until <= now]:
            log.warning("the checkpoint freeze by %s lapsed without a thaw", holder)
            del self._holders[holder]
        if not self._holders and self.at is not None:
            self.at, self._members = None, set()

    def holds(self, name: str, next_step: int) -> bool:
        """Whether ``name`` may not begin ``next_step`` while frozen."""
        if self.at is None:
            return False
        return name not in self._members or next_step > self.at

    def park(self, name: str, pending: Pending) -> None:
        self._parkers.append((name, pending))

    def answer_parkers(self, parked: Callable[[str], bool]) -> list[Callable[[], None]]:
        """Answer each ``park``ed caller once it is held (True), or once nothing holds it (False)."""
        actions = []
        for name, pending in list(self._parkers):
            held = parked(name)
            if held or self.at is None:     # thawed before it parked: not held
                self._parkers.remove((name, pending))
                actions.append(lambda p=pending, h=held: p.set_result(h))
        return actions
