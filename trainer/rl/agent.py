"""The RL agent role: holds the policy, runs episodes on the observers, learns after each one.

Threads: the role thread (``run``) runs batches of episodes on request (``trainer/rl/episodes.py``); RPC threads answer the
observers' action requests (``act``, batched, or the seed's ``select_action``/``report_reward``)
and complete their episodes; the sidecar thread calls the control methods. Shared state is under
``_lock``; the learner and the batcher have their own locks and are never called with ``_lock`` held.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Optional

import torch

from services.checkpoint.coordinator import CheckpointPlan, Coordinator
from services.checkpoint.parts import restore_newest
from services.checkpoint.periodic import take_final
from services.checkpoint.store import CheckpointInfo
from trainer.rl.config import AgentConfig
from services.control import EpisodeGate, EpisodeStart
from services.errors import BadRequest, CheckpointError, CheckpointInProgress, NotReady
from services.lifecycle import RoleState
from services.progress import Progress
from services.remote import serve, withdraw
from services.role import RoleBase, RoleContext
from trainer.rl.batching import ActionBatcher
from trainer.rl.env import threshold
from trainer.rl.episodes import EpisodePlayer
from trainer.rl.policy import Learner, LearnerConfig, LearnerPart, solved
from trainer.rl.service import AgentService
from trainer.rl.stubs import ObserverClient

log = logging.getLogger(__name__)

FINAL_CHECKPOINT_SECONDS = 5.0


class AgentRole(RoleBase, AgentService):
    role = "agent"

    def __init__(self, cfg: AgentConfig, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self.learner = Learner(LearnerConfig(cfg.hidden, cfg.dropout, cfg.lr, cfg.gamma, cfg.seed))
        self.learner_part = LearnerPart(self.learner)    # what its checkpoints hold
        self.batcher = ActionBatcher(self._act_batch)
        self.threshold = threshold(cfg.env)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # A request runs a batch of episodes: N of them, or until solved.
        self.gate = EpisodeGate(self._wake, "agent", EpisodeStart(episodes=cfg.episodes) if cfg.start else None)
        self.player = EpisodePlayer(cfg, self.learner, self.batcher, ObserverClient(cfg.rpc_timeout), self.board,
                                    self.metrics, self.gate, self._wake)
        self.coordinator: Optional[Coordinator] = None   # checkpoints of this cluster of one, once joined
        self._batches = 0
        self.progress = Progress(self.board, self.metrics)
        self._solved = False                        # any batch of this process passed the threshold

    def start_episode(self, request: EpisodeStart) -> dict[str, Any]:
        if request.steps is not None:
            raise BadRequest('the agent counts episodes: send {"episodes": N}, or {} to run until solved')
        self.gate.start(request, self.board.ready())
        return {"started": True, "episodes": request.episodes, "until_solved": request.episodes is None}

    def stop_episode(self) -> dict[str, Any]:
        if not self.gate.stop():
            return {"stopping": False, "cancelled": True}
        return {"stopping": True, "after_episode": self.learner.episodes + 1}

    def checkpoint(self) -> dict[str, Any]:
        if self.coordinator is None:
            raise NotReady("not joined yet")
        result = self.coordinator.take()
        self.board.update(last_checkpoint={k: result[k] for k in ("id", "step", "path")})
        return result

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.store.list()]

    def _act(self, observer: str, state: list[float]) -> torch.futures.Future:
        return self.batcher.submit(observer, state)

    def _select_action(self, observer: str, state: list[float]) -> int:
        self._check_playing(observer)
        self.metrics.observe_batch(1)
        return self.learner.act([(observer, state)])[0]

    def _report_reward(self, observer: str, reward: float) -> None:
        self._check_playing(observer)
        self.learner.reward(observer, [reward])

    def _check_playing(self, observer: str) -> None:
        if not self.player.playing(observer):
            raise BadRequest(f"{observer} is not taking part in the current episode")

    def _act_batch(self, requests: list[tuple[str, list[float]]]) -> list[int]:
        self.metrics.observe_batch(len(requests))
        return self.learner.act(requests)

    def request_stop(self) -> None:
        self.gate.close()

    def run(self) -> None:
        resumed = self._restore()
        self._publish()
        self.board.update(env=self.cfg.env, batched=self.cfg.batched, threshold=self.threshold, solved=False,
                          observers_lost=0, env_steps=0, batch=None)
        self.checkpoints.add(self.learner_part)
        self._join("joining the RPC group")
        self.coordinator = Coordinator(self.store, self._plan(), self.cfg.keep_checkpoints, local=self.checkpoints,
                                       metrics=self.metrics, resumed=resumed)
        serve(self.coordinator)
        self.membership.add_listener(self.player.member_gone)
        self.metrics.up.set(1)
        self.board.set_state(RoleState.IDLE, "waiting for an episode request")
        while True:
            request = self.gate.next(self._heartbeat)
            if request is None:
                return
            self._batches += 1
            self._run_batch(request)

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        self._final_checkpoint()
        self._leave()
        if self.coordinator is not None:
            withdraw(self.coordinator)

    def _run_batch(self, request: EpisodeStart) -> None:
        batch = {"id": self._batches, "episodes": request.episodes, "done": 0, "finished": False, "solved": False}
        self.board.update(batch=dict(batch))
        self.progress.start("episodes", request.episodes)
        self.board.set_state(RoleState.RUNNING, "running episodes")
        self.metrics.episode_running.set(1)
        try:
            while request.episodes is None or batch["done"] < request.episodes:
                with self._lock:
                    if self.gate.stop_requested:
                        break
                observers = self.player.wait_for_observers()
                if observers is None:
                    break
                result = self.player.play(observers)
                if result is None:
                    continue
                batch["done"] += 1
                self.board.update(batch=dict(batch))
                self.progress.advance(batch["done"])
                if self.cfg.checkpoint_every_episodes and result.episode % self.cfg.checkpoint_every_episodes == 0:
                    self._checkpoint_quietly()
                if solved(result.running_reward, self.threshold):
                    batch["solved"] = True
                    log.info("solved: running reward %.1f > %.1f after episode %d", result.running_reward,
                             self.threshold, result.episode)
                    break
        finally:
            batch["finished"] = True
            self.metrics.episode_running.set(0)
            self.gate.finish()
            self._solved |= batch["solved"]
            self.board.update(batch=dict(batch), solved=self._solved)
            self.board.set_state(RoleState.IDLE, "solved; waiting for an episode request" if batch["solved"]
                                 else "waiting for an episode request")

    def _restore(self) -> Optional[CheckpointInfo]:
        """The learner from the newest valid checkpoint in this agent's folder (or a fresh one)."""
        def files(info: CheckpointInfo) -> list[str]:
            if LearnerPart.FILE not in info.files:
                raise CheckpointError(f"{info.id} in {self.store.root} is not an RL agent checkpoint (it has "
                                      f"{sorted(info.files)}); use another --checkpoint-dir or --no-resume")
            return [LearnerPart.FILE]

        def load(states: Optional[list[dict[str, Any]]]) -> None:
            if states is None:
                return
            try:
                self.learner_part.load_state_dict(states[0])
            except (KeyError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"cannot load the agent from the checkpoint: {exc}") from None

        info, _ = restore_newest(self.store, self.cfg.resume, self.cfg.resume_from, files, load)
        if info is not None:
            self.board.update(resumed_from={"id": info.id, "step": info.step, "path": str(info.path)})
            log.info("resuming from %s: episode %d, running reward %.1f", info.id, self.learner.episodes,
                     self.learner.running_reward)
        return info

    def _plan(self) -> CheckpointPlan:
        cfg = self.cfg
        return CheckpointPlan(holders=(LearnerPart.name,), meta={
            "workload": "rl", "env": cfg.env,
            "policy": {"hidden": cfg.hidden, "dropout": cfg.dropout, "lr": cfg.lr, "gamma": cfg.gamma, "seed": cfg.seed}})

    def _publish(self) -> None:
        """The learner's numbers on the board and metrics (after a restore, before any episode)."""
        self.board.update(episode=self.learner.episodes, last_reward=self.learner.last_reward,
                          running_reward=self.learner.running_reward)
        self.metrics.rl_running_reward.set(self.learner.running_reward)

    def _checkpoint_quietly(self) -> None:
        try:
            self.checkpoint()
        except CheckpointInProgress:
            pass
        except Exception:  # noqa: BLE001 - training goes on; the previous checkpoint stays valid
            log.exception("periodic checkpoint failed")

    def _final_checkpoint(self) -> None:
        if self.coordinator is None or (self.coordinator.latest is None and self.learner.episodes == 0):
            return
        take_final(functools.partial(self.coordinator.take_unless_saved, self.learner.episodes),
                   FINAL_CHECKPOINT_SECONDS)
