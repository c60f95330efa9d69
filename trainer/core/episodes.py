"""A trainer's episodes, for any server-hosted workload: steps until the episode's target or a
stop, each at a step boundary a checkpoint may hold; progress on the status board and in the
metrics; then the task's held-out evaluation. Runs on the role thread."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ps.client.cache import CacheCounts
from services.control import EpisodeGate, EpisodeStart, StepPause
from services.errors import PeerUnavailable, ServerLost, StepLost, UpdateRefused
from services.lifecycle import RoleState, StatusBoard
from services.progress import Progress
from trainer.core.loop import StepResult, TrainLoop
from trainer.core.metrics import TrainerMetrics

log = logging.getLogger(__name__)


@dataclass
class _Throughput:
    """An episode's units (tokens, samples) a second, its first steps (``warmup``) left out: they
    pay connection set-up and allocation. ``window`` is wall-clock, so ``rpcps up`` can add up
    trainers' windows; it names its count by the unit."""

    warmup: int
    unit: str
    units: int = 0
    seconds: float = 0.0
    start: Optional[float] = None
    end: Optional[float] = None

    def add(self, step: int, result: StepResult, started: float) -> float:
        if step > self.warmup:
            self.units += result.units
            self.seconds += result.seconds
            self.start, self.end = self.start or started, time.time()
        return self.units / self.seconds if self.seconds else result.units / result.seconds

    @property
    def window(self) -> dict[str, Any]:
        return {self.unit: self.units, "start": self.start, "end": self.end}


class DataWait:
    """A task with no batch now (a followed folder between files): the trainer waits at a step
    boundary, where a checkpoint may hold it and a stop ends it, a slice at a time. Once a wait
    begins, it tells where it is (``tell``), so that a replacement, should it die there, goes on
    from exactly there, and leaves the step clock (``leave``), so that in sync mode nobody's step
    waits for it: one with a batch more of a file, or a replacement a step out of phase, steps on."""

    SLICE = 0.5       # seconds a wait looks for data before the boundary is checked again

    def __init__(self, loop: TrainLoop, board: StatusBoard, tell: Callable[[], None],
                 leave: Callable[[], None]) -> None:
        self.loop, self.board, self.tell, self.leave = loop, board, tell, leave
        self.waiting: Optional[str] = None      # the state's words before the wait began

    def ready(self) -> bool:
        if self.loop.ready(self.SLICE if self.waiting is not None else 0.0):
            if self.waiting is not None:
                self.board.set_state(RoleState.RUNNING, self.waiting)
                self.waiting = None
            return True
        if self.waiting is None:
            self.waiting = self.board.snapshot()["reason"]
            self.leave()
            self.tell()             # before the state says so: whoever reads it may count on it
            self.board.set_state(RoleState.RUNNING, "waiting for data")
        return False


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
        self.refused = 0            # steps skipped because their update was refused
        self.lost = 0               # steps skipped because they failed on their way (StepLost)
        self.server_losses = 0      # times a server went away under this trainer's step
        self._refused_in_a_row = 0
        self._traffic: dict[str, Any] = {"steps": 0, "rpc_bytes": 0, "rpcs": 0, "allreduce_bytes": 0,
                                         "bytes_saved": 0, "timed_steps": 0, "phase_seconds": {}}
        self._cache = CacheCounts()        # --cache-rows: what the copies gave, over every step so far
        self._digests: deque[tuple[int, str]] = deque(maxlen=128)   # --dense allreduce: the replica's last steps
        self.progress = Progress(board, metrics)
        self.data = DataWait(loop, board, tell, self._leave_clock)

    def run(self, request: EpisodeStart) -> None:
        self.episodes += 1
        episode = {"id": self.episodes, "step": 0, "steps": request.steps, "done": False}
        self.board.update(episode=dict(episode))
        self.progress.start("train", request.steps)
        self.board.set_state(RoleState.RUNNING, f"episode {self.episodes}")
        self.metrics.episode_running.set(1)
        log.info("episode %d: %s steps", self.episodes, request.steps or "unbounded")
        try:
            try:
                self._train(episode, request.steps)
            finally:
                self._leave_clock()
            with self._wake:
                shutting_down = self.gate.closing
            if self.evaluates and not shutting_down and episode["step"] > 0:
                self._evaluate()
        finally:
            episode["done"] = True
            self.metrics.episodes.inc()
            self.board.update(episode=dict(episode), episodes_completed=self.episodes)
            self.metrics.episode_running.set(0)
            self.gate.finish()
            self.board.set_state(RoleState.IDLE, "waiting for an episode")
            log.info("episode %d done after %d steps", self.episodes, episode["step"])

    def _train(self, episode: dict[str, Any], target: Optional[int]) -> None:
        recent: deque[float] = deque(maxlen=20)
        first_loss: Optional[float] = None
        throughput = _Throughput(self.cfg.warmup_steps, self.unit)
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
                result = self.loop.step()
            except ServerLost as exc:
                if not self._await_servers(exc):
                    return
                continue
            except (UpdateRefused, StepLost) as exc:
                self._skip(exc)
                continue
            self._refused_in_a_row = 0
            self.steps += 1
            episode["step"] += 1
            first_loss = result.loss if first_loss is None else first_loss
            recent.append(result.loss)
            per_s = throughput.add(episode["step"], result, started)
            self.metrics.per_second.set(per_s)
            self.board.update(step=self.steps, episode=dict(episode), loss=result.loss,
                              loss_avg=sum(recent) / len(recent), loss_first=first_loss,
                              **{f"{self.unit}_per_s": per_s}, grad_norm=result.grad_norm, timed=throughput.window,
                              step_seconds={k: round(v, 6) for k, v in result.phases.items()},
                              moved=self._count_traffic(result, episode["step"] > self.cfg.warmup_steps),
                              **self._replica_status(), **self._cache_status(result))
            self.progress.advance(episode["step"])
            if time.monotonic() - last_log >= self.cfg.log_interval:
                last_log = time.monotonic()
                self._heartbeat()
                log.info("step %d | loss %.3f | %.0f %s/s", self.steps, sum(recent) / len(recent), per_s, self.unit)

    def _skip(self, exc: Exception) -> None:
        """A step the servers refused, or lost on its way (``StepLost``): its batch is skipped;
        many in a row end the trainer, since the cause (bad data, a diverging learning rate, a
        group that cannot form) will not go away by itself."""
        lost = isinstance(exc, StepLost)
        if lost:
            self.lost += 1
            self.board.update(lost_steps=self.lost)
        else:
            self.refused += 1
            self.metrics.steps_refused.inc()
            self.board.update(refused_steps=self.refused)
        self._refused_in_a_row += 1
        log.warning("step skipped, %s (%d in a row): %s", "lost" if lost else "its update refused",
                    self._refused_in_a_row, exc)
        if self._refused_in_a_row >= self.cfg.max_refused_steps:
            raise type(exc)(f"{self._refused_in_a_row} steps in a row were refused or lost (the last: {exc}); "
                            f"stopping rather than spinning: check the data, --lr and --clip, and the trainers' "
                            f"connections to each other")

    def _await_servers(self, lost: ServerLost) -> bool:
        """A server went away under a step: that step is lost (its batch skipped), and this trainer
        waits, quiet (a checkpoint may hold it at once), until every lost server serves again, up
        to ``--server-wait`` seconds, then ``PeerUnavailable``. False if asked to stop meanwhile.
        A loss is an operational event, not the trainer's failure: it counts toward no limit."""
        client = self.loop.model.client
        self.lost += 1
        self.server_losses += 1
        waiting = list(lost.servers)
        log.warning("step lost, waiting up to %gs for %s: %s", self.cfg.server_wait, ", ".join(waiting), lost)
        self.metrics.server_losses.inc()
        self.metrics.waiting_for_servers.set(len(waiting))
        started = time.monotonic()
        try:
            with self.pause.quiet():
                while waiting:
                    self.board.update(lost_steps=self.lost, server_losses=self.server_losses, waiting_for=waiting,
                                      waiting_s=round(time.monotonic() - started, 1))
                    self.board.set_state(RoleState.RUNNING, f"waiting for {', '.join(waiting)}")
                    back = client.returned(waiting)
                    waiting = [n for n in waiting if n not in back]
                    if not waiting:
                        break
                    if time.monotonic() - started > self.cfg.server_wait:
                        raise PeerUnavailable(f"{', '.join(waiting)} did not come back within "
                                              f"{self.cfg.server_wait:g}s (--server-wait); stopping")
                    with self._wake:
                        if self.gate.stop_requested:
                            return False
                        self._wake.wait(0.2)
        finally:
            self.metrics.waiting_for_servers.set(0)
            self.board.update(waiting_for=[], waiting_s=None)
        log.info("%s back after %.1fs; training goes on", ", ".join(lost.servers), time.monotonic() - started)
        self.board.set_state(RoleState.RUNNING, f"episode {self.episodes}")
        return True

    def _count_traffic(self, result: StepResult, timed: bool) -> dict[str, Any]:
        """``timed``: past the warm-up steps, whose set-up costs would blur where a step's time goes."""
        t = self._traffic
        t["steps"] += 1
        t["rpc_bytes"] += result.rpc_bytes
        t["rpcs"] += result.rpcs
        t["allreduce_bytes"] += result.allreduce_bytes
        t["bytes_saved"] += result.cache.saved if result.cache is not None else 0
        if timed:
            t["timed_steps"] += 1
            for phase, seconds in result.phases.items():
                t["phase_seconds"][phase] = t["phase_seconds"].get(phase, 0.0) + seconds
        return {**t, "phase_seconds": {k: round(v, 6) for k, v in t["phase_seconds"].items()}}

    def _cache_status(self, result: StepResult) -> dict[str, Any]:
        """--cache-rows: what the trainer's copies of rows gave, so far."""
        step = result.cache
        if step is None:
            return {}
        c = self._cache
        c.add(step)
        asked = c.hits + c.misses
        return {"cache": {"hits": c.hits, "misses": c.misses, "bytes_saved": c.saved, "lookups": c.lookups,
                          "rows": c.rows, "oldest": c.max_age, "hit_rate": c.hits / asked if asked else 0.0,
                          "lookup_hit_rate": c.hit_lookups / c.lookups if c.lookups else 0.0}}

    def _replica_status(self) -> dict[str, Any]:
        """--dense allreduce: which step the replica is at, its digest (equal on every trainer of
        the group at that step) and the group."""
        replica = self.loop.model.replica
        if replica is None:
            return {}
        step, digest = replica.digested()       # as one: the weights at that step
        if not self._digests or self._digests[-1][0] != step:
            self._digests.append((step, digest))
        return {"dense_replica": {"step": step, "digest": digest, "allreduce_group": list(replica.group),
                                  "group_id": replica.group_key, "digests": list(self._digests)}}

    def _leave_clock(self) -> None:
        """Between episodes this trainer takes no steps: in sync and ssp modes nobody may wait for it."""
        self.loop.idle()
        try:
            self.loop.model.client.end()
        except Exception as exc:  # noqa: BLE001 - ps0 gone: nobody to tell, and stopping goes on
            log.warning("could not leave the step clock: %s", str(exc).splitlines()[0])

    def _evaluate(self) -> None:
        self.board.update(evaluating=True)
        self.progress.start("evaluate", None)
        with self.pause.quiet():     # evaluation changes neither parameters nor position
            found = self.loop.task.evaluate(lambda: self.gate.closing, self.progress.advance)
        self.board.update(evaluating=False, **found)
