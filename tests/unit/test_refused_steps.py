"""A trainer whose updates the servers refuse, or whose steps are lost on their way (a peer in
the trainers' all-reduce died), skips those batches, and stops with a clear error after too many
in a row rather than spinning (the episode runner, over a scripted loop)."""
import threading

import pytest
from prometheus_client import CollectorRegistry

from services.control import EpisodeGate, EpisodeStart, StepPause
from services.errors import StepLost, UpdateRefused
from services.lifecycle import StatusBoard
from trainer.lm.config import TrainerConfig
from trainer.core.episodes import EpisodeRunner
from trainer.core.loop import StepResult
from trainer.lm.metrics import TrainerMetrics
from trainer.lm.status import TrainerStatus


class ScriptedLoop:
    """Each step answers from ``script``: True a step applied, False one refused, "lost" one lost."""

    def __init__(self, script):
        self.script = list(script)
        self.model = self     # the runner leaves the step clock through loop.model.client.end()
        self.client = self
        self.replica = None
        self.task = self
        self.unit = "tokens"

    def step(self):
        outcome = self.script.pop(0)
        if outcome == "lost":
            raise StepLost("this step was lost, nothing of it applied: Connection reset by peer")
        if not outcome:
            raise UpdateRefused("trainer0's update in context 7 is not finite; nothing of it was applied")
        return StepResult(loss=1.0, units=10, seconds=0.01, grad_norm=0.5)

    def end(self):
        pass


def runner(script, max_refused=3):
    wake = threading.Condition()
    gate = EpisodeGate(wake, "trainer")
    metrics = TrainerMetrics(CollectorRegistry(), "trainer", "trainer0")
    board = StatusBoard("trainer", "trainer0", TrainerStatus)
    cfg = TrainerConfig(name="trainer0", num_ps=1, max_refused_steps=max_refused)
    return EpisodeRunner(ScriptedLoop(script), cfg, board, metrics, gate, StepPause(wake, gate), wake,
                         False, heartbeat=lambda: None), metrics, board


def test_refused_steps_are_skipped_and_counted():
    run, metrics, board = runner([True, False, "lost", True, False, True, True])
    run.run(EpisodeStart(steps=4))
    assert run.steps == 4 and run.refused == 2 and run.lost == 1
    assert metrics.steps_refused._value.get() == 2
    assert board.snapshot()["refused_steps"] == 2 and board.snapshot()["lost_steps"] == 1


def test_too_many_refusals_in_a_row_stop_the_trainer_with_a_clear_error():
    run, _, _ = runner([True, False, False, False, True], max_refused=3)
    with pytest.raises(UpdateRefused, match="3 steps in a row were refused or lost .* check the data, --lr and --clip"):
        run.run(EpisodeStart(steps=10))
    assert run.steps == 1


def test_lost_steps_count_towards_the_limit_too():
    run, _, _ = runner([True, "lost", False, "lost", True], max_refused=3)
    with pytest.raises(StepLost, match="3 steps in a row were refused or lost .* connections to each other"):
        run.run(EpisodeStart(steps=10))
