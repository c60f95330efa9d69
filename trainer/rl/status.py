"""The RL agent's and observers' /status: what `rpcps status` and `rpcps up` read of them."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from services.lifecycle import RoleStatus


class BatchProgress(BaseModel):
    """A request's batch of episodes."""

    id: int
    episodes: Optional[int] = None     # asked for (None: until solved)
    done: int = 0
    finished: bool = False
    solved: bool = False


class AgentStatus(RoleStatus):
    env: Optional[str] = None
    batched: Optional[bool] = None
    threshold: Optional[float] = None
    solved: bool = False
    batch: Optional[BatchProgress] = None
    episode: int = 0
    last_reward: Optional[float] = None
    running_reward: Optional[float] = None
    rewards: Optional[dict[str, float]] = None
    steps_per_s: Optional[float] = None
    env_steps: int = 0
    observers: Optional[list[str]] = None
    observers_lost: int = 0
    last_lost: Optional[list[str]] = None
    history: list[dict[str, Any]] = []   # the last episodes, for progress readers (rpcps up)

    def line(self) -> list[str]:
        last, running = self.last_reward, self.running_reward
        return [f"episode {self.episode}", "reward -" if last is None else f"reward {last:.1f}",
                "running -" if running is None else f"running {running:.1f}",
                "- steps/s" if self.steps_per_s is None else f"{self.steps_per_s:.0f} steps/s",
                f"members {len(self.members or [])}", *self.eta()]


class ObserverStatus(RoleStatus):
    env: Optional[str] = None
    episode: Optional[int] = None
    episodes: int = 0
    env_steps: int = 0
    last_reward: Optional[float] = None
    steps_per_s: Optional[float] = None

    def line(self) -> list[str]:
        return [f"episodes {self.episodes}", f"{self.env_steps} env steps"]
