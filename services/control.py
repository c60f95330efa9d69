"""The control surface every role offers its sidecar, the request/response bodies shared by the
sidecar, the HTTP client and the CLI, and the pieces of it that roles share."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field

from services.errors import EpisodeConflict, NotReady


class EpisodeStart(BaseModel):
    """Body of POST /episode/start: how much work (omit for unbounded)."""

    model_config = ConfigDict(extra="forbid")
    steps: Optional[int] = Field(None, ge=1, description="LM: training steps in this episode")
    episodes: Optional[int] = Field(None, ge=1, description="RL: CartPole episodes (omit: until solved)")


class Controllable(Protocol):
    def healthy(self) -> tuple[bool, str]: ...
    def ready(self) -> tuple[bool, str]: ...
    def status(self) -> dict[str, Any]: ...
    def start_episode(self, request: EpisodeStart) -> dict[str, Any]: ...
    def stop_episode(self) -> dict[str, Any]: ...
    def checkpoint(self) -> dict[str, Any]: ...
    def list_checkpoints(self) -> list[dict[str, Any]]: ...


class EpisodeGate:
    """Episode requests between the sidecar thread (``start``/``stop``) and the role thread
    (``next``/``finish``). It uses the role's condition variable, so the role can wait on the same
    one for its own reasons (a checkpoint's pause) and be woken by a stop."""

    def __init__(self, wake: threading.Condition, what: str, first: Optional[EpisodeStart] = None) -> None:
        self._wake, self._what = wake, what
        self.pending = first            # started by a request, not yet picked up
        self.running = False
        self.stop_requested = False     # stop the running episode at its next boundary
        self.closing = False            # the role is shutting down

    def start(self, request: EpisodeStart, ready: tuple[bool, str]) -> None:
        with self._wake:
            if not ready[0]:
                raise NotReady(f"{self._what} not ready: {ready[1]}")
            if self.running or self.pending is not None:
                raise EpisodeConflict("an episode is already running; stop it first")
            self.pending = request
            self._wake.notify_all()

    def stop(self) -> bool:
        """True: the running episode will stop; False: a request not yet started was cancelled."""
        with self._wake:
            if self.pending is not None and not self.running:
                self.pending = None
                return False
            if not self.running:
                raise EpisodeConflict("no episode is running")
            self.stop_requested = True
            return True

    def close(self) -> None:
        with self._wake:
            self.closing = self.stop_requested = True
            self._wake.notify_all()

    def next(self, idle: Callable[[], None]) -> Optional[EpisodeStart]:
        """Wait for a request (calling ``idle`` about once a second); None once closing."""
        with self._wake:
            while self.pending is None and not self.closing:
                self._wake.wait(1.0)
                idle()
            if self.closing:
                return None
            request, self.pending = self.pending, None
            self.running, self.stop_requested = True, False
            return request

    def finish(self) -> None:
        with self._wake:
            self.running = self.stop_requested = False
            self._wake.notify_all()


class StepPause:
    """A checkpoint's hold on a loop at its step boundary: ``hold``/``release`` from the thread
    that takes the checkpoint, ``boundary`` from the loop at each step boundary. A loop that is idle
    (no episode runs) or inside ``quiet`` work (which changes nothing a checkpoint saves) counts as
    held at once. It shares the role's condition variable with the ``EpisodeGate``, so a stop wakes
    a held loop."""

    def __init__(self, wake: threading.Condition, gate: EpisodeGate) -> None:
        self._wake, self._gate = wake, gate
        self._requested = False
        self._held = False
        self._quiet = False

    def hold(self, timeout: float) -> bool:
        """Stop the loop at its next step boundary; False, and no hold, if it is not there within
        ``timeout``. The hold lasts until ``release``."""
        deadline = time.monotonic() + timeout
        with self._wake:
            self._requested = True
            self._wake.notify_all()
            while self._gate.running and not (self._held or self._quiet):
                if not self._wake.wait(max(0.0, deadline - time.monotonic())):
                    self._requested = False
                    self._wake.notify_all()
                    return False
            return True

    def release(self) -> None:
        with self._wake:
            self._requested = False
            self._wake.notify_all()

    def boundary(self) -> None:
        """The loop, at a step boundary, holding the condition's lock: wait out a hold (or a stop)."""
        while self._requested and not self._gate.closing:
            self._held = True
            self._wake.notify_all()
            self._wake.wait(1.0)
        self._held = False

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        with self._wake:
            self._quiet = True
            self._wake.notify_all()
        try:
            yield
        finally:
            with self._wake:
                self._quiet = False
