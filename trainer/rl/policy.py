"""The RL agent's learning, without RPC: the policy, how actions are drawn, and REINFORCE.

Actions for several observers are chosen in one forward pass (``Learner.act``), but every random
draw (dropout mask, action) comes from that observer's own generator, seeded from the run's seed
and the observer's index. So the actions an observer gets depend only on its states and the seed,
not on which other observers share the batch or in what order their states arrived: batched and
one-at-a-time selection give the same actions, and a run is reproducible.

The forward pass that picks actions runs without autograd; ``finish_episode`` recomputes the
log-probabilities of every recorded step in one pass with the recorded dropout masks (the same
numbers), which is cheaper than keeping a graph per step.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from services.checkpoint.parts import SnapshotPart

OBS_DIM, ACTIONS = 4, 2           # CartPole-v1
RUNNING_DECAY = 0.05              # running reward = 0.05 * this episode + 0.95 * before (as the seed)


@dataclass(frozen=True)
class LearnerConfig:
    hidden: int = 128
    dropout: float = 0.6
    lr: float = 1e-2
    gamma: float = 0.99
    seed: int = 1


class Policy(nn.Module):
    """Linear(4, hidden) - dropout - ReLU - Linear(hidden, 2), as the seed; dropout masks are inputs."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.affine1 = nn.Linear(OBS_DIM, hidden)
        self.affine2 = nn.Linear(hidden, ACTIONS)

    def forward(self, states: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [n, ACTIONS] of [n, OBS_DIM] states under [n, hidden] dropout masks."""
        return torch.log_softmax(self.affine2(torch.relu(self.affine1(states) * masks)), dim=-1)


@dataclass
class _Trajectory:
    states: list[list[float]] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class EpisodeResult:
    episode: int
    rewards: dict[str, float]           # each observer's total reward this episode
    reward: float                       # their mean: this episode's reward
    running_reward: float
    steps: int                          # environment steps learned from
    loss: float


class Learner:
    """Policy, optimizer and the episode being recorded. Thread-safe: RPC threads call ``act``."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.seed)      # the policy's initial weights
        self.policy = Policy(cfg.hidden)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr)
        self._lock = threading.Lock()
        self._generators: dict[str, torch.Generator] = {}
        self._episode: dict[str, _Trajectory] = {}
        self.episodes = 0
        self.running_reward = 0.0
        self.last_reward: Optional[float] = None

    # --- acting --------------------------------------------------------------------------------------
    def act(self, requests: Sequence[tuple[str, Sequence[float]]]) -> list[int]:
        """Actions for ``(observer, state)`` pairs, in one forward pass."""
        if not requests:
            return []
        keep = 1.0 - self.cfg.dropout
        hidden = self.cfg.hidden
        with self._lock:
            # One draw per observer from its own generator: a dropout mask and a uniform for the action.
            draws = [torch.rand(hidden + 1, generator=self._generator(name)) for name, _ in requests]
            masks = torch.stack([d[:hidden] for d in draws]).lt_(keep).float().div_(keep)
            states = torch.tensor([list(s) for _, s in requests], dtype=torch.float32)
            with torch.no_grad():
                probs = self.policy(states, masks).exp().tolist()
            actions = []
            for i, (name, state) in enumerate(requests):
                action = _inverse_cdf(probs[i], float(draws[i][hidden]))
                trajectory = self._episode.setdefault(name, _Trajectory())
                trajectory.states.append(states[i].tolist())
                trajectory.actions.append(action)
                trajectory.masks.append(masks[i])
                actions.append(action)
            return actions

    def reward(self, name: str, rewards: Sequence[float]) -> None:
        """The rewards of ``name``'s steps so far this episode, in order (appended)."""
        with self._lock:
            self._episode.setdefault(name, _Trajectory()).rewards.extend(float(r) for r in rewards)

    def drop(self, name: str) -> None:
        """Forget ``name``'s part of this episode (it died in the middle)."""
        with self._lock:
            self._episode.pop(name, None)

    def _generator(self, name: str) -> torch.Generator:
        g = self._generators.get(name)
        if g is None:
            g = torch.Generator().manual_seed(_observer_seed(self.cfg.seed, name))
            self._generators[name] = g
        return g

    # --- learning ------------------------------------------------------------------------------------
    def finish_episode(self) -> Optional[EpisodeResult]:
        """REINFORCE on every complete trajectory of this episode; None when there was none."""
        with self._lock:
            episode, self._episode = self._episode, {}
            trajectories = {n: t for n, t in sorted(episode.items())
                            if t.actions and len(t.rewards) == len(t.actions)}
            if not trajectories:
                return None
            returns = torch.cat([_discounted(t.rewards, self.cfg.gamma) for t in trajectories.values()])
            returns = (returns - returns.mean()) / (returns.std(unbiased=True) + torch.finfo(torch.float32).eps) \
                if returns.numel() > 1 else returns * 0
            states = torch.tensor([s for t in trajectories.values() for s in t.states], dtype=torch.float32)
            masks = torch.stack([m for t in trajectories.values() for m in t.masks])
            actions = torch.tensor([a for t in trajectories.values() for a in t.actions])
            log_probs = self.policy(states, masks).gather(1, actions.unsqueeze(1)).squeeze(1)
            loss = -(log_probs * returns).sum()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            totals = {n: sum(t.rewards) for n, t in trajectories.items()}
            reward = sum(totals.values()) / len(totals)
            self.episodes += 1
            self.running_reward = RUNNING_DECAY * reward + (1 - RUNNING_DECAY) * self.running_reward
            self.last_reward = reward
            return EpisodeResult(self.episodes, totals, reward, self.running_reward, int(actions.numel()), float(loss.detach()))

    # --- checkpoints ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything needed to go on learning: copies, taken at one instant."""
        with self._lock:
            return {"policy": {k: v.clone() for k, v in self.policy.state_dict().items()},
                    "optimizer": _clone(self.optimizer.state_dict()),
                    "episodes": self.episodes, "running_reward": self.running_reward,
                    "last_reward": self.last_reward, "config": vars(self.cfg).copy(),
                    "generators": {n: g.get_state() for n, g in self._generators.items()}}

    def load(self, state: dict[str, Any]) -> None:
        with self._lock:
            saved = state.get("config", {})
            if saved.get("hidden") != self.cfg.hidden:
                raise ValueError(f"the checkpoint's policy has {saved.get('hidden')} hidden units, this agent "
                                 f"{self.cfg.hidden}")
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.episodes, self.running_reward = int(state["episodes"]), float(state["running_reward"])
            self.last_reward = state.get("last_reward")
            for name, g_state in state.get("generators", {}).items():
                self._generators[name] = torch.Generator()
                self._generators[name].set_state(g_state)
            self._episode = {}


class LearnerPart(SnapshotPart):
    """The agent's learner in its checkpoints (a cluster of one: the agent holds all there is)."""

    name = "agent"
    FILE = "agent.pt"

    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load(state)

    def step(self, state: dict[str, Any]) -> int:
        return int(state["episodes"])

    def describe(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"running_reward": state["running_reward"]}


def _inverse_cdf(probs: list[float], u: float) -> int:
    """The action whose cumulative probability first exceeds the uniform draw ``u``."""
    total = 0.0
    for action, p in enumerate(probs):
        total += p
        if u < total:
            return action
    return len(probs) - 1


def _discounted(rewards: Sequence[float], gamma: float) -> torch.Tensor:
    out, running = [0.0] * len(rewards), 0.0
    for i in range(len(rewards) - 1, -1, -1):
        running = rewards[i] + gamma * running
        out[i] = running
    return torch.tensor(out, dtype=torch.float32)


def _observer_seed(seed: int, name: str) -> int:
    # Stable across processes and runs (Python's hash() of a str is salted per process).
    digits = "".join(c for c in name if c.isdigit())
    return (seed * 1_000_003 + (int(digits) if digits else 0) * 7919 + 17) % (2 ** 63)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def solved(running_reward: float, threshold: float) -> bool:
    return math.isfinite(running_reward) and running_reward > threshold
