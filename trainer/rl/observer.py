"""The observer role: joins the agent's group, then steps its own environment whenever the agent
runs an episode on it (``run_episode``, in an RPC thread), asking the agent for every action."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from services.checkpoint.coordinator import Coordinator
from trainer.rl.config import ObserverConfig
from services.errors import EpisodeConflict
from services.lifecycle import RoleState
from services.names import parse_name
from services.role import RoleBase, RoleContext, WithoutEpisodes
from trainer.rl.env import make_env
from trainer.rl.service import EpisodeReport, ObserverService
from trainer.rl.stubs import AgentClient

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = 120.0   # a checkpoint asked for through an observer


class ObserverRole(RoleBase, WithoutEpisodes, ObserverService):
    role = "observer"
    no_episodes = "observers run the episodes the agent starts; POST /episode/{} on the agent"

    def __init__(self, cfg: ObserverConfig, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self.env = make_env(cfg.env)
        self.agent = AgentClient(cfg.name, cfg.rpc_timeout)
        self._env_seed: Optional[int] = cfg.seed * 1000 + parse_name(cfg.name).index  # first reset only
        self._busy = threading.Lock()     # one episode at a time: the environment is not shareable
        self._stop = threading.Event()
        self._episodes = 0
        self._steps = 0

    def checkpoint(self) -> dict[str, Any]:
        return self._ask_coordinator(Coordinator.take, timeout=CONTROL_TIMEOUT)

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return self._ask_coordinator(Coordinator.listing, timeout=CONTROL_TIMEOUT)

    def _run_episode(self, episode: int, batched: bool, max_steps: Optional[int]) -> EpisodeReport:
        if not self._busy.acquire(blocking=False):
            raise EpisodeConflict(f"{self.cfg.name} is already running an episode")
        try:
            self.board.set_state(RoleState.RUNNING, f"episode {episode}")
            state, _ = self.env.reset(seed=self._env_seed)
            self._env_seed = None       # later resets continue the environment's own generator
            rewards: list[float] = []
            started = time.perf_counter()
            while max_steps is None or len(rewards) < max_steps:
                values = [float(x) for x in state]
                action = self.agent.act(values) if batched else self.agent.select_action(values)
                state, reward, terminated, truncated, _ = self.env.step(action)
                rewards.append(float(reward))
                if not batched:
                    self.agent.report_reward(float(reward))    # the seed's second call per step
                self.metrics.env_steps.inc()
                if terminated or truncated or self._stop.is_set():
                    break
            seconds = time.perf_counter() - started
            self._episodes += 1
            self._steps += len(rewards)
            self.board.update(episode=episode, episodes=self._episodes, env_steps=self._steps,
                              last_reward=sum(rewards), steps_per_s=len(rewards) / seconds if seconds > 0 else None)
            return EpisodeReport(self.cfg.name, len(rewards), rewards if batched else [], sum(rewards))
        finally:
            self.board.set_state(RoleState.IDLE, "waiting for the agent")
            self._busy.release()

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.board.update(env=self.cfg.env, episodes=0, env_steps=0)
        self._join("joining the agent's group")
        self.metrics.up.set(1)
        self.board.set_state(RoleState.IDLE, "waiting for the agent")
        while not self._stop.wait(1.0):
            self._heartbeat()

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        if self._busy.acquire(timeout=2.0):   # an episode in flight sees the stop within a step
            self._busy.release()
        self._leave()
        self.env.close()
