"""The RL workload's stubs: how an observer calls the agent and the agent its observers."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from services.remote import call, call_async
from trainer.rl.service import AGENT, AgentService, ObserverService


class AgentClient:
    """What an observer calls on the agent."""

    def __init__(self, me: str, timeout: float) -> None:
        self.me, self.timeout = me, timeout

    def act(self, state: Sequence[float]) -> int:
        return call(AGENT, AgentService.act, self.me, list(state), timeout=self.timeout)

    def select_action(self, state: Sequence[float]) -> int:
        return call(AGENT, AgentService.select_action, self.me, list(state), timeout=self.timeout)

    def report_reward(self, reward: float) -> None:
        call(AGENT, AgentService.report_reward, self.me, reward, timeout=self.timeout)


EPISODE_TIMEOUT = 60.0     # seconds an episode may take, at least


class ObserverClient:
    """What the agent calls on an observer."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def run_episode(self, observer: str, episode: int, batched: bool,
                    max_steps: Optional[int]) -> torch.futures.Future:
        """The episode's ``EpisodeReport``, as a future (``services.remote.wait`` it). An episode
        runs many steps: it may take longer than one peer may stay silent (the RPC timeout)."""
        return call_async(observer, ObserverService.run_episode, episode, batched, max_steps,
                          timeout=max(self.timeout, EPISODE_TIMEOUT))
