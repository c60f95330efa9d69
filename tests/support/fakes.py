"""Stand-ins for what a route test needs: a control object that records what it was asked."""
from __future__ import annotations

from typing import Any

from services.control import EpisodeStart
from services.errors import EpisodeConflict, NotReady, NotSupported


class FakeControl:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.is_ready = True
        self.running = False

    def healthy(self) -> tuple[bool, str]:
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        return self.is_ready, "ready" if self.is_ready else "joining"

    def status(self) -> dict[str, Any]:
        return {"role": "trainer", "name": "trainer0", "state": "running" if self.running else "idle"}

    def start_episode(self, request: EpisodeStart) -> dict[str, Any]:
        if not self.is_ready:
            raise NotReady("not joined yet")
        if self.running:
            raise EpisodeConflict("an episode is already running")
        self.calls.append(("start", request.steps))
        self.running = True
        return {"started": True, "steps": request.steps}

    def stop_episode(self) -> dict[str, Any]:
        if not self.running:
            raise EpisodeConflict("no episode is running")
        self.calls.append(("stop", None))
        self.running = False
        return {"stopping": True}

    def checkpoint(self) -> dict[str, Any]:
        raise NotSupported("not here")

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return []
