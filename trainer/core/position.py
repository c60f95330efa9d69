"""A trainer's position in cluster checkpoints: held at a step boundary while the servers copy
their shards, then saved by the coordinator. What a position holds is the workload's (its
``Task.position``); no RPC here."""
from __future__ import annotations

from typing import Any, Callable, Protocol

from services.checkpoint.parts import PausedPart
from services.errors import CheckpointError


class Hold(Protocol):
    """Where a checkpoint holds the trainer: its own step boundary (``services.control.StepPause``,
    async) or the step clock (``ps.client.clock.ClockPause``, sync and ssp)."""

    def hold(self, timeout: float) -> bool: ...
    def release(self) -> None: ...


class PositionPart(PausedPart):
    def __init__(self, name: str, pause: Hold, position: Callable[[], dict[str, Any]]) -> None:
        self.name, self._pause, self._position = name, pause, position

    def pause(self, timeout: float) -> None:
        if not self._pause.hold(timeout):
            raise CheckpointError(f"{self.name} did not reach a step boundary in {timeout:.0f}s")

    def resume(self) -> None:
        self._pause.release()

    def state_dict(self) -> dict[str, Any]:
        return self._position()
