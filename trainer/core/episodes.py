"""A trainer's episodes, for any server-hosted workload: steps until the episode's target or a
stop, each at a step boundary a checkpoint may hold, then the task's held-out evaluation. Runs on
the role thread. What it hands off, each in a file of its own: waiting for data
(``data_wait.py``), steps that did not apply (``step_failures.py``), and what the status says of
each step (``step_report.py``)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from services.control import EpisodeGate, EpisodeStart, StepPause
from services.errors import ServerLost, StaleLayout, StepLost, UpdateRefused
from services.lifecycle import RoleState, StatusBoard
from services.progress import Progress
from trainer.core.data_wait import DataWait
from trainer.core.loop import TrainLoop
from trainer.core.metrics import TrainerMetrics
from trainer.core.step_failures import StepFailures
from trainer.core.step_report import StepReport

log = logging.getLogger(__name__)


class EpisodeRunner:
    """``cfg``: the trainer's settings (``trainer/core/config.py``); ``evaluate``: whether episodes
    end with the task's held-out evaluation; ``tell``: say where it is as it begins to wait for data."""

    def __init__(self, loop: TrainLoop, cfg: Any, board: StatusBoard, metrics: TrainerMetrics,
                 gate: EpisodeGate, pause: StepPause, wake: threading.Condition, evaluate: bool,
                 heartbeat: Callable[[], Any], steps: int = 0, tell: Callable[[], None] = lambda: None) -> None:
        self.loop, self.cfg, self.board, self.metrics = loop, cfg, board, metrics
        self.gate, self.pause, self._wake, self.evaluates = gate, pause, wake, evaluate
        self.unit = loop.task.unit
        self._heartbeat = heartbeat       # the members, into the status, with each log line
        self.steps = steps          # this trainer's steps, across episodes and restores
        self.episodes = 0
        self.progress = Progress(board, metrics)
        self.data = DataWait(loop, board, tell, self._leave_clock)
        self.failures = StepFailures(cfg, board, metrics, gate, pause, wake,
                                     lambda names: loop.model.client.losses.returned(names),
                                     lambda: loop.model.client.follow_layout())
        self.report = StepReport(cfg.warmup_steps, self.unit, lambda: loop.model.replica)

    def run(self, request: EpisodeStart) -> None:
        self.episodes += 1
        episode = {"id": self.episodes, "step": 0, "steps": request.steps, "done": False}
        self.board.update(episode=dict(episode))
        self.progress.start("train", request.steps)
        self.board.set_state(RoleState.RUNNING, f"episode {self.episodes}")
        self.metrics.episode_running.set(1)
        log.info("episode %d: %s steps", self.episodes, request.steps or "unbounded")
        ended = False
        try:
            try:
                self._train(episode, request.steps)
            finally:
                self._leave_clock()
            with self._wake:
                shutting_down = self.gate.closing
            if self.evaluates and not shutting_down and episode["step"] > 0:
                self._evaluate()
            ended = True
        finally:
            # An episode that failed is not done: a supervisor would take the job for finished.
            episode["done"] = ended
            self.metrics.episodes.inc()
            self.board.update(episode=dict(episode), episodes_completed=self.episodes)
            self.metrics.episode_running.set(0)
            self.gate.finish()
            self.board.set_state(RoleState.IDLE, "waiting for an episode")
            log.info("episode %d %s after %d steps", self.episodes, "done" if ended else "failed", episode["step"])

    def _train(self, episode: dict[str, Any], target: Optional[int]) -> None:
        self.report.new_episode()
        last_log = time.monotonic()
        while target is None or episode["step"] < target:
            with self._wake:
                self.pause.boundary()
                if self.gate.stop_requested:
                    return
            if not self.data.ready():
                continue
            started = time.time()
            try:
                result = self.loop.step(self.steps + 1)
            except ServerLost as exc:
                if not self.failures.await_servers(exc):
                    return
                self.board.set_state(RoleState.RUNNING, f"episode {self.episodes}")
                continue
            except StaleLayout as exc:
                self.failures.relaid(exc)
                continue
            except (UpdateRefused, StepLost) as exc:
                self.failures.skip(exc)
                continue
            self.failures.applied()
            self.steps += 1
            episode["step"] += 1
            fields = self.report.add(episode["step"], result, started)
            self.metrics.per_second.set(self.report.per_s)
            # Progress first: a status read between the two never shows a step without its rate.
            self.progress.advance(episode["step"])
            self.board.update(step=self.steps, episode=dict(episode), **fields)
            if time.monotonic() - last_log >= self.cfg.log_interval:
                last_log = time.monotonic()
                self._heartbeat()
                log.info("step %d | loss %.3f | %.0f %s/s", self.steps, self.report.loss_avg, self.report.per_s,
                         self.unit)

    def _leave_clock(self) -> None:
        """Between episodes this trainer takes no steps: in sync and ssp modes nobody may wait for it."""
        self.loop.idle()
        try:
            self.loop.model.client.clock.end()
        except Exception as exc:  # noqa: BLE001 - ps0 gone: nobody to tell, and stopping goes on
            log.warning("could not leave the step clock: %s", str(exc).splitlines()[0])

    def _evaluate(self) -> None:
        self.board.update(evaluating=True)
        with self.pause.quiet():     # evaluation changes neither parameters nor position
            while True:
                self.progress.start("evaluate", None)
                try:
                    found = self.loop.task.evaluate(lambda: self.gate.closing, self.progress.advance)
                    break
                except StaleLayout:
                    # A change of layout is not held back by an evaluation, which changes nothing:
                    # it reads again from the start, by the leader's layout, as long as that moves.
                    if not self.loop.model.client.follow_layout():
                        raise
                    log.info("a change of layout moved rows the evaluation read: evaluating again")
        self.board.update(evaluating=False, **found)
