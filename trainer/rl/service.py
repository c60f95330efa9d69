"""The RL workload's RPC surface: what the agent and each observer answer, and the stubs that call them.

Agent (RPC name ``agent``):
  ``act(observer, state) -> action``             batched: answered when every observer's state is in
  ``select_action(observer, state) -> action``   the seed's way: one forward pass for this observer
  ``report_reward(observer, reward)``            the seed's way: one call per environment step
  ``checkpoint()``, ``list_checkpoints()``       for an observer's sidecar
Observer (``observer<N>``):
  ``run_episode(episode, batched, max_steps) -> EpisodeReport``

Requests are validated here, so a malformed one gets ``BadRequest`` and the process keeps serving.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed.rpc as rpc

from services.errors import BadRequest
from services.names import parse_name
from services.rpc import wait
from services.slots import Slot
from trainer.rl.policy import OBS_DIM

AGENT = "agent"
CONTROL_TIMEOUT = 120.0   # a checkpoint asked for through an observer


@dataclass(frozen=True)
class EpisodeReport:
    observer: str
    steps: int
    rewards: list[float]          # every step's reward (batched); empty when reported step by step
    total: float                  # the episode's total reward either way


class AgentSurface(Protocol):
    def act(self, observer: str, state: list[float]) -> torch.futures.Future: ...
    def select_action(self, observer: str, state: list[float]) -> int: ...
    def report_reward(self, observer: str, reward: float) -> None: ...
    def checkpoint(self) -> dict[str, Any]: ...
    def list_checkpoints(self) -> list[dict[str, Any]]: ...


class ObserverSurface(Protocol):
    def run_episode(self, episode: int, batched: bool, max_steps: Optional[int]) -> EpisodeReport: ...


AGENT_SLOT = Slot("agent")
OBSERVER_SLOT = Slot("observer")


def check_observer(observer: Any) -> str:
    if not isinstance(observer, str):
        raise BadRequest(f"observer must be a name, got {type(observer).__name__}")
    try:
        if parse_name(observer).role != "observer":
            raise ValueError(f"{observer!r} is not an observer name")
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return observer


def check_state(observer: Any, state: Any) -> tuple[str, list[float]]:
    check_observer(observer)
    if not isinstance(state, (list, tuple)) or len(state) != OBS_DIM:
        raise BadRequest(f"state must be a list of {OBS_DIM} numbers, got {state!r:.80}")
    try:
        values = [float(x) for x in state]
    except (TypeError, ValueError):
        raise BadRequest(f"state must be a list of {OBS_DIM} numbers, got {state!r:.80}") from None
    if not all(math.isfinite(x) for x in values):
        raise BadRequest(f"state must be finite, got {values}")
    return observer, values


# --- entry points (module-level: RPC pickles functions by name) ----------------------------------------
@rpc.functions.async_execution
def _agent_act(observer: str, state: Any) -> torch.futures.Future:
    try:
        return AGENT_SLOT.get().act(*check_state(observer, state))
    except Exception as exc:  # noqa: BLE001 - returned as the future's error, like any other answer
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(exc)
        return fut


def _agent_call(method: str, observer: str, value: Any) -> Any:
    agent = AGENT_SLOT.get()
    if method == "select_action":
        return agent.select_action(*check_state(observer, value))
    if method == "report_reward":
        check_observer(observer)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"reward must be a finite number, got {value!r:.80}")
        return agent.report_reward(observer, float(value))
    raise BadRequest(f"unknown agent method {method!r}")


def _agent_control(method: str) -> Any:
    if method not in ("checkpoint", "list_checkpoints"):
        raise BadRequest(f"unknown agent control method {method!r}")
    return getattr(AGENT_SLOT.get(), method)()


def _observer_call(method: str, *args: Any) -> Any:
    observer = OBSERVER_SLOT.get()
    if method != "run_episode" or len(args) != 3:
        raise BadRequest(f"unknown observer method {method!r} with {len(args)} arguments")
    episode, batched, max_steps = args
    if not isinstance(episode, int) or not isinstance(batched, bool) or not (
            max_steps is None or (isinstance(max_steps, int) and max_steps >= 1)):
        raise BadRequest(f"run_episode(episode: int, batched: bool, max_steps: int >= 1 | None), got {args!r:.120}")
    return observer.run_episode(episode, batched, max_steps)


# --- stubs -----------------------------------------------------------------------------------------------
class AgentClient:
    """What an observer calls on the agent."""

    def __init__(self, me: str, timeout: float) -> None:
        self.me, self.timeout = me, timeout

    def act(self, state: Sequence[float]) -> int:
        return wait(rpc.rpc_async(AGENT, _agent_act, args=(self.me, list(state)), timeout=self.timeout))

    def select_action(self, state: Sequence[float]) -> int:
        return wait(rpc.rpc_async(AGENT, _agent_call, args=("select_action", self.me, list(state)), timeout=self.timeout))

    def report_reward(self, reward: float) -> None:
        wait(rpc.rpc_async(AGENT, _agent_call, args=("report_reward", self.me, reward), timeout=self.timeout))

    def checkpoint(self) -> dict[str, Any]:
        return wait(rpc.rpc_async(AGENT, _agent_control, args=("checkpoint",), timeout=CONTROL_TIMEOUT))

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return wait(rpc.rpc_async(AGENT, _agent_control, args=("list_checkpoints",), timeout=CONTROL_TIMEOUT))


class ObserverClient:
    """What the agent calls on an observer."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def run_episode(self, observer: str, episode: int, batched: bool, max_steps: Optional[int]) -> torch.futures.Future:
        return rpc.rpc_async(observer, _observer_call, args=("run_episode", episode, batched, max_steps),
                             timeout=self.timeout)
