"""Environments the observers step: gymnasium's CartPole-v1, or a fixed-length stand-in for tests
that only check the plumbing (the gymnasium API either way)."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

CARTPOLE = "CartPole-v1"
CARTPOLE_THRESHOLD = 475.0        # gymnasium's reward_threshold for CartPole-v1
_FIXED = re.compile(r"^fixed:(\d+)$")


class FixedLengthEnv:
    """Ends after exactly ``length`` steps whatever the actions; reward 1 per step; states drawn
    from the seeded generator, so runs repeat."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._rng = np.random.default_rng(0)
        self._t = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        return self._rng.uniform(-0.05, 0.05, 4).astype(np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if action not in (0, 1):
            raise ValueError(f"action must be 0 or 1, got {action!r}")
        self._t += 1
        return self._rng.uniform(-0.05, 0.05, 4).astype(np.float32), 1.0, False, self._t >= self.length, {}

    def close(self) -> None:
        pass


def make_env(kind: str) -> Any:
    m = _FIXED.match(kind)
    if m:
        return FixedLengthEnv(int(m.group(1)))
    if kind == CARTPOLE:
        import gymnasium
        return gymnasium.make(CARTPOLE)
    raise ValueError(f"unknown environment {kind!r}: expected {CARTPOLE} or fixed:<steps>")


def threshold(kind: str) -> float:
    """The running reward above which ``kind`` counts as solved."""
    m = _FIXED.match(kind)
    return float(int(m.group(1))) - 0.5 if m else CARTPOLE_THRESHOLD
