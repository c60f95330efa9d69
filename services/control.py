"""The control surface every role offers its sidecar, and the request/response bodies shared by
the sidecar, the HTTP client and the CLI."""
from __future__ import annotations

from typing import Any, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field


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
