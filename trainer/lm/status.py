"""A language-model trainer's /status: what `rpcps status` and `rpcps up` read of it."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from services.lifecycle import RoleStatus


class EpisodeProgress(BaseModel):
    id: int
    step: int = 0
    steps: Optional[int] = None        # the episode's target (None: unbounded)
    done: bool = False


class HeldOut(BaseModel):
    loss_sum: float                    # summed over tokens, so shares from several trainers add up
    tokens: int
    loss: float
    ppl: float


class TimedWindow(BaseModel):
    """An episode's timed tokens and wall-clock window (warm-up steps left out)."""

    tokens: int = 0
    start: Optional[float] = None
    end: Optional[float] = None


class TrainerStatus(RoleStatus):
    step: int = 0                      # this trainer's steps, across episodes and restarts
    refused_steps: int = 0             # steps skipped because the servers refused their update
    episode: Optional[EpisodeProgress] = None
    episodes_completed: int = 0
    model: Optional[dict[str, Any]] = None
    data: Optional[str] = None
    consistency: Optional[str] = None  # the servers' (async, sync, ssp:K)
    loss: Optional[float] = None
    loss_avg: Optional[float] = None   # of the last 20 steps
    loss_first: Optional[float] = None
    tokens_per_s: Optional[float] = None
    grad_norm: Optional[float] = None
    timed: Optional[TimedWindow] = None
    step_seconds: Optional[dict[str, float]] = None
    evaluating: bool = False
    eval: Optional[HeldOut] = None

    def line(self) -> list[str]:
        ep = self.episode
        return [f"step {self.step}",
                f"episode {ep.id if ep else '-'} {ep.step if ep else 0}/{(ep.steps if ep else None) or '∞'}",
                f"loss {self.loss_avg:.3f}" if self.loss_avg is not None else "loss -",
                f"{self.tokens_per_s or 0:.0f} tokens/s", f"consistency {self.consistency or '-'}"] \
            + ([f"{self.refused_steps} steps refused"] if self.refused_steps else [])
