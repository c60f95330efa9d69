"""Waiting for data at a step boundary: a task with no batch now (a followed folder between files)
waits where a checkpoint may hold it and a stop ends it, tells where it is, and leaves the step
clock meanwhile (``DataWait``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from services.lifecycle import RoleState, StatusBoard

if TYPE_CHECKING:
    from trainer.core.loop import TrainLoop


class DataWait:
    """A task with no batch now (a followed folder between files): the trainer waits at a step
    boundary, where a checkpoint may hold it and a stop ends it, a slice at a time. Once a wait
    begins, it tells where it is (``tell``), so that a replacement, should it die there, goes on
    from exactly there, and leaves the step clock (``leave``), so that in sync mode nobody's step
    waits for it: one with a batch more of a file, or a replacement a step out of phase, steps on."""

    SLICE = 0.5       # seconds a wait looks for data before the boundary is checked again

    def __init__(self, loop: "TrainLoop", board: StatusBoard, tell: Callable[[], None],
                 leave: Callable[[], None]) -> None:
        self.loop, self.board, self.tell, self.leave = loop, board, tell, leave
        self.waiting: Optional[str] = None      # the state's words before the wait began

    def ready(self) -> bool:
        if self.loop.ready(self.SLICE if self.waiting is not None else 0.0):
            if self.waiting is not None:
                self.board.set_state(RoleState.RUNNING, self.waiting)
                self.waiting = None
            return True
        if self.waiting is None:
            self.waiting = self.board.snapshot()["reason"]
            self.leave()
            self.tell()             # before the state says so: whoever reads it may count on it
            self.board.set_state(RoleState.RUNNING, "waiting for data")
        return False
