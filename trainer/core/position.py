"""A trainer's position in cluster checkpoints: held at a step boundary while the servers copy
their shards, then saved by the coordinator. What a position holds is the workload's (its
``Task.position``); no RPC here."""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from services.checkpoint.parts import PausedPart
from services.errors import CheckpointError


class Hold(Protocol):
    """Where a checkpoint holds the trainer: its own step boundary (``services.control.StepPause``,
    async) or the step clock (``ps.client.clock.ClockPause``, sync and ssp)."""

    def hold(self, timeout: float) -> bool: ...
    def release(self) -> None: ...


class PositionPart(PausedPart):
    def __init__(self, name: str, pause: Hold, position: Callable[[], dict[str, Any]],
                 before_resuming: Callable[[], Any] = lambda: None) -> None:
        """``before_resuming``: what the trainer does while still held, as it is let go (take
        the leader's layout again: a change of layout happens while the trainers are held)."""
        self.name, self._pause, self._position, self._before = name, pause, position, before_resuming

    def pause(self, timeout: float) -> None:
        if not self._pause.hold(timeout):
            raise CheckpointError(f"{self.name} did not reach a step boundary in {timeout:.0f}s")

    def resume(self) -> None:
        try:
            self._before()
        finally:
            self._pause.release()

    def state_dict(self) -> dict[str, Any]:
        return self._position()


def resume_from(saved: Optional[dict[str, Any]], marks: list[Optional[dict[str, Any]]], name: str
                ) -> Optional[dict[str, Any]]:
    """Where trainer ``name`` resumes: ``saved`` (the coordinator's ``positions``: every trainer's
    in the newest checkpoint, or told since), with its own replaced by the oldest of the servers'
    ``marks`` of it (``PsSurface.applied_mark``) when every server holds one and it is newer. A
    server its last update did not reach has not trained that batch: it is trained again, and a
    server that holds it already answers without applying it (``ps/server/marks.py``)."""
    if not marks or any(m is None for m in marks):
        return saved
    oldest = min(marks, key=lambda m: int(m["steps"]))
    states = list(saved["states"]) if saved is not None else []
    mine = next((s for s in states if s.get("name") == name), None)
    if mine is not None and int(mine.get("steps", -1)) >= int(oldest["steps"]):
        return saved
    checkpoint = saved["checkpoint"] if saved is not None else "no checkpoint"
    states = [s for s in states if s is not mine] + [dict(oldest["position"])]
    return {**(saved or {}), "states": states,
            "checkpoint": f"{checkpoint}, then the servers' updates to step {oldest['steps']}"}
