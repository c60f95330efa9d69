"""The agent's episodes on its observers.

``EpisodePlayer`` plays one episode after another: it waits for observers that answer, starts the
episode on each, waits for it to end, learns from it, and publishes the result. ``Episode`` is
the bookkeeping of one episode: who still plays, whose report is in, who was lost. RPC callbacks
(an observer's report or failure), the membership listener and the agent's role thread all touch
them, under the agent's condition variable, which also wakes the role thread when the episode is
over or a stop comes.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import torch

from services.control import EpisodeGate
from services.lifecycle import RoleState, StatusBoard
from services.membership import current_members, reachable
from services.names import parse_name
from trainer.rl.batching import ActionBatcher
from trainer.rl.config import AgentConfig
from trainer.rl.metrics import RlMetrics
from trainer.rl.policy import EpisodeResult, Learner
from trainer.rl.service import EpisodeReport
from trainer.rl.stubs import ObserverClient

log = logging.getLogger(__name__)

STOP_WAIT = 5.0          # how long a stopping agent waits for the episode in flight
HISTORY = 200            # episodes kept in /status for progress readers (rpcps up prints each one)


class Episode:
    def __init__(self, number: int, observers: list[str], learner: Learner, batcher: Optional[ActionBatcher],
                 wake: threading.Condition, on_lost: Callable[[str, str], None]) -> None:
        """``batcher``: the one answering the observers' actions (None: they ask one at a time).
        ``on_lost(observer, why)`` runs once per observer lost, outside the lock."""
        self.number = number
        self._learner, self._batcher, self._wake, self._on_lost = learner, batcher, wake, on_lost
        self._playing = set(observers)
        self.reports: dict[str, EpisodeReport] = {}
        self.lost: list[str] = []
        if batcher is not None:
            batcher.begin(observers)

    def playing(self, observer: str) -> bool:
        with self._wake:
            return observer in self._playing

    def finish(self, observer: str, report: EpisodeReport) -> None:
        """``observer`` played its episode to the end."""
        if not self.playing(observer):
            return            # already counted as lost
        # Rewards in, and the batch no longer waiting for it, before the episode can be seen as over:
        # the next episode must not meet this one's leftovers.
        if self._batcher is not None:
            self._learner.reward(observer, report.rewards)
            self._batcher.leave(observer)
        with self._wake:
            if observer in self._playing:
                self._playing.discard(observer)
                self.reports[observer] = report
                self._wake.notify_all()

    def lose(self, observer: str, why: str) -> None:
        """``observer`` will not finish: the others go on, and nothing of its part is learned from."""
        if not self.playing(observer):
            return
        self._learner.drop(observer)
        if self._batcher is not None:
            self._batcher.leave(observer)
        with self._wake:
            if observer not in self._playing:
                return
            self._playing.discard(observer)
            self.lost.append(observer)
            self._wake.notify_all()
        self._on_lost(observer, why)

    def wait(self, closing: Callable[[], bool], members: Callable[[], list[str]], stop_wait: float) -> None:
        """Until every observer has finished or is lost. One no longer a member never answers (the
        leader evicted it as dead); one still listed gets until its RPC times out. Once ``closing()``,
        the observers still playing get ``stop_wait`` seconds more."""
        stop_deadline: Optional[float] = None
        while True:
            with self._wake:
                if not self._playing:
                    return
                if closing() and stop_deadline is None:
                    stop_deadline = time.monotonic() + stop_wait
                abandon = stop_deadline is not None and time.monotonic() > stop_deadline
                if not abandon:
                    self._wake.wait(0.5)
                playing = set(self._playing)
            if abandon:
                for o in sorted(playing):
                    self.lose(o, "the agent is stopping and waited long enough")
            for o in sorted(playing - set(members())):
                self.lose(o, "no longer a member")


class EpisodePlayer:
    def __init__(self, cfg: AgentConfig, learner: Learner, batcher: ActionBatcher, observers: ObserverClient,
                 board: StatusBoard, metrics: RlMetrics, gate: EpisodeGate, wake: threading.Condition) -> None:
        self.cfg, self.learner, self.batcher, self.observers = cfg, learner, batcher, observers
        self.board, self.metrics, self.gate, self._wake = board, metrics, gate, wake
        self._episode: Optional[Episode] = None     # the episode in flight
        self._reachable: set[str] = set()
        self._env_steps = 0
        self._lost_total = 0                        # observers lost mid-episode since start
        self._played = 0                            # episodes played by this process
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    def playing(self, observer: str) -> bool:
        with self._wake:
            episode = self._episode
        return episode is not None and episode.playing(observer)

    def wait_for_observers(self) -> Optional[list[str]]:
        while True:
            members = current_members()
            observers = [m for m in members if parse_name(m).role == "observer"]
            # A member is listed a moment before it can be called (services.membership.reachable).
            with self._wake:
                known = set(self._reachable)
            fresh = {o for o in observers if o not in known and self._answers(o)}
            with self._wake:
                self._reachable |= fresh
                ready = [o for o in observers if o in self._reachable]
            need = self.cfg.min_observers if self._played == 0 else 1
            if len(ready) >= need:
                return ready
            self.board.update(members=members)
            self.board.set_state(RoleState.RUNNING, f"waiting for observers ({len(ready)} of {need})")
            with self._wake:
                if self.gate.stop_requested:
                    return None
                self._wake.wait(0.5)

    @staticmethod
    def _answers(observer: str) -> bool:
        try:
            return reachable(observer, timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - a dead observer still listed: the watchdog evicts it
            log.info("%s does not answer yet: %s", observer, str(exc).splitlines()[0])
            return False

    def play(self, observers: list[str]) -> Optional[EpisodeResult]:
        """One episode on ``observers``, then learn from it; None when no observer finished it."""
        episode = Episode(self.learner.episodes + 1, observers, self.learner,
                          self.batcher if self.cfg.batched else None, self._wake, self._observer_lost)
        with self._wake:
            self._episode = episode
        self.board.set_state(RoleState.RUNNING, f"episode {episode.number} with {len(observers)} observers")
        started = time.perf_counter()
        for o in observers:
            try:
                fut = self.observers.run_episode(o, episode.number, self.cfg.batched, self.cfg.max_steps)
            except Exception as exc:  # noqa: BLE001 - e.g. evicted a moment ago: the others play on
                episode.lose(o, str(exc).splitlines()[0])
                continue
            fut.add_done_callback(lambda f, o=o: self._reported(episode, o, f))
        episode.wait(lambda: self.gate.closing, current_members, STOP_WAIT)
        seconds = time.perf_counter() - started
        result = self.learner.finish_episode()
        steps = sum(r.steps for r in episode.reports.values())
        self._env_steps += steps
        self.metrics.env_steps.inc(steps)
        if result is None:
            log.warning("episode %d: no observer finished it (lost: %s)", episode.number,
                        ", ".join(episode.lost) or "none")
            return None
        self._played += 1
        self._publish_episode(result, episode, steps / seconds if seconds > 0 else 0.0)
        return result

    def _publish_episode(self, result: EpisodeResult, episode: Episode, rate: float) -> None:
        reports, lost = episode.reports, episode.lost
        steps = sum(r.steps for r in reports.values())
        self._history.append({"episode": result.episode, "reward": result.reward,
                              "running_reward": result.running_reward, "observers": len(reports),
                              "env_steps": steps, "steps_per_s": rate, "lost": lost})
        self.metrics.episodes.inc()
        self.metrics.rl_reward.set(result.reward)
        self.metrics.rl_running_reward.set(result.running_reward)
        self.metrics.rl_steps_per_second.set(rate)
        with self._wake:
            lost_total = self._lost_total
        self.board.update(episode=result.episode, last_reward=result.reward, running_reward=result.running_reward,
                          rewards=result.rewards, steps_per_s=rate, env_steps=self._env_steps,
                          observers=sorted(reports), members=current_members(), history=list(self._history),
                          observers_lost=lost_total, last_lost=lost or None)
        log.info("episode %d | reward %.1f | running reward %.1f | %d observers | %.0f steps/s%s", result.episode,
                 result.reward, result.running_reward, len(reports), rate,
                 f" | lost {', '.join(lost)}" if lost else "")

    def _reported(self, episode: Episode, observer: str, fut: torch.futures.Future) -> None:
        try:
            report: EpisodeReport = fut.value()
        except Exception as exc:  # noqa: BLE001 - an observer's failure ends only its part of the episode
            episode.lose(observer, str(exc).splitlines()[0])
            return
        episode.finish(observer, report)

    def _observer_lost(self, observer: str, why: str) -> None:
        with self._wake:
            self._lost_total += 1
        log.warning("lost %s in the middle of an episode: %s", observer, why)
        self.metrics.rl_observers_lost.inc()

    def member_gone(self, name: str) -> None:
        with self._wake:
            self._reachable.discard(name)
            episode = self._episode
        if episode is not None:
            episode.lose(name, "removed from the group")
