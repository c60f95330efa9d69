"""The RL workload's RPC surfaces: what the agent and each observer answer (their stubs are in
``trainer/rl/stubs.py``).

Agent (RPC name ``agent``):
  ``act(observer, state) -> action``             batched: answered when every observer's state is in
  ``select_action(observer, state) -> action``   the seed's way: one forward pass for this observer
  ``report_reward(observer, reward)``            the seed's way: one call per environment step
Observer (``observer<N>``):
  ``run_episode(episode, batched, max_steps) -> EpisodeReport``

Argument types are checked by ``services/remote.py``; what they must mean (an observer's name, a
state of the environment's size, finite numbers) is checked here, so a malformed request gets
``BadRequest`` and the process keeps serving. The roles implement the surfaces.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Optional

import torch

from services.errors import BadRequest
from services.names import parse_name
from services.remote import Service, remote
from trainer.rl.policy import OBS_DIM

AGENT = "agent"


@dataclass(frozen=True)
class EpisodeReport:
    observer: str
    steps: int
    rewards: list[float]          # every step's reward (batched); empty when reported step by step
    total: float                  # the episode's total reward either way


class AgentService(Service, abc.ABC):
    """What observers call on the agent. The public methods check the request and call the
    role's ``_act``/``_select_action``/``_report_reward``."""

    @remote(asynchronous=True)
    def act(self, observer: str, state: list[float]) -> torch.futures.Future:
        return self._act(check_observer(observer), check_state(state))

    @remote
    def select_action(self, observer: str, state: list[float]) -> int:
        return self._select_action(check_observer(observer), check_state(state))

    @remote
    def report_reward(self, observer: str, reward: float) -> None:
        if not math.isfinite(reward):
            raise BadRequest(f"reward must be a finite number, got {reward!r}")
        self._report_reward(check_observer(observer), reward)

    @abc.abstractmethod
    def _act(self, observer: str, state: list[float]) -> torch.futures.Future: ...

    @abc.abstractmethod
    def _select_action(self, observer: str, state: list[float]) -> int: ...

    @abc.abstractmethod
    def _report_reward(self, observer: str, reward: float) -> None: ...


class ObserverService(Service, abc.ABC):
    """What the agent calls on an observer."""

    @remote
    def run_episode(self, episode: int, batched: bool, max_steps: Optional[int]) -> EpisodeReport:
        if max_steps is not None and max_steps < 1:
            raise BadRequest(f"max_steps must be >= 1 or None, got {max_steps}")
        return self._run_episode(episode, batched, max_steps)

    @abc.abstractmethod
    def _run_episode(self, episode: int, batched: bool, max_steps: Optional[int]) -> EpisodeReport: ...


def check_observer(observer: str) -> str:
    try:
        if parse_name(observer).role != "observer":
            raise ValueError(f"{observer!r} is not an observer name")
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return observer


def check_state(state: list[float]) -> list[float]:
    if len(state) != OBS_DIM or not all(math.isfinite(x) for x in state):
        raise BadRequest(f"state must be a list of {OBS_DIM} finite numbers, got {state!r:.80}")
    return state
