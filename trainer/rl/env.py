"""Environments the observers step (the gymnasium API in every case):

* ``CartPole-v1``: gymnasium's;
* ``CartPole-v1:N``: CartPole-v1 restarted whenever it ends, until exactly N steps. Every episode
  then has the same length whatever the policy does, which is how the seed's benchmark compared
  designs; it is for measuring, not for learning (returns run across the restarts);
* ``fixed:N``: a stand-in of exactly N steps, for tests that only check the plumbing.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:        # numpy is imported where an environment is made: settings only need the names
    import numpy as np

CARTPOLE = "CartPole-v1"
CARTPOLE_THRESHOLD = 475.0        # gymnasium's reward_threshold for CartPole-v1
_STEPS = r"[1-9][0-9]*"
_FIXED = re.compile(rf"^fixed:({_STEPS})$")
_RESTARTING = re.compile(rf"^{CARTPOLE}:({_STEPS})$")
ENV_PATTERN = rf"^({CARTPOLE}|{CARTPOLE}:{_STEPS}|fixed:{_STEPS})$"   # every kind above, for settings


def _generator(seed: int) -> "np.random.Generator":
    import numpy as np
    return np.random.default_rng(seed)


class FixedLengthEnv:
    """Ends after exactly ``length`` steps whatever the actions; reward 1 per step; states drawn
    from the seeded generator, so runs repeat."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._rng = _generator(0)
        self._t = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self._rng = _generator(seed)
        self._t = 0
        return self._rng.uniform(-0.05, 0.05, 4).astype("float32"), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if action not in (0, 1):
            raise ValueError(f"action must be 0 or 1, got {action!r}")
        self._t += 1
        return self._rng.uniform(-0.05, 0.05, 4).astype("float32"), 1.0, False, self._t >= self.length, {}

    def close(self) -> None:
        pass


class RestartingEnv:
    """``inner`` restarted whenever it terminates or truncates, until exactly ``length`` steps."""

    def __init__(self, inner: Any, length: int) -> None:
        self.inner, self.length = inner, length
        self._t = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        self._t = 0
        return self.inner.reset(seed=seed)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        state, reward, terminated, truncated, info = self.inner.step(action)
        self._t += 1
        if terminated or truncated:
            state, _ = self.inner.reset()
        return state, reward, False, self._t >= self.length, info

    def close(self) -> None:
        self.inner.close()


def make_env(kind: str) -> Any:
    m = _FIXED.match(kind)
    if m:
        return FixedLengthEnv(int(m.group(1)))
    m = _RESTARTING.match(kind)
    if m:
        return RestartingEnv(make_env(CARTPOLE), int(m.group(1)))
    if kind == CARTPOLE:
        import gymnasium
        return gymnasium.make(CARTPOLE)
    raise ValueError(f"unknown environment {kind!r}: expected {CARTPOLE}, {CARTPOLE}:<steps> or fixed:<steps>")


def threshold(kind: str) -> float:
    """The running reward above which ``kind`` counts as solved (a fixed length: never below it)."""
    m = _FIXED.match(kind) or _RESTARTING.match(kind)
    return float(int(m.group(1))) - 0.5 if m else CARTPOLE_THRESHOLD
