"""A language-model trainer's /status: what `rpcps status` and `rpcps up` read of it, besides
every trainer's (``trainer/core/status.py``)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel

from trainer.core.status import TrainerStatusBase


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


class TrainerStatus(TrainerStatusBase):
    tokens_per_s: Optional[float] = None
    timed: Optional[TimedWindow] = None
    eval: Optional[HeldOut] = None     # its own share of the held-out split
    eval_all: Optional[HeldOut] = None  # --dense allreduce: every trainer's share, summed by all_reduce

    def line(self) -> list[str]:
        return self.steps_line() + [f"{self.tokens_per_s or 0:.0f} tokens/s", f"consistency {self.consistency or '-'}"] \
            + self.eta() + self.failures_line()
