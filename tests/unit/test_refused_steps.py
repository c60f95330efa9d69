"""A trainer whose updates the servers refuse, or whose steps are lost on their way (a peer in
the trainers' all-reduce died), skips those batches, and stops with a clear error after too many
in a row rather than spinning; one that loses a step to a server's loss waits for the server, as
long as it may, and counts it toward no limit; an evaluation a change of layout falls in is read
again by the new layout (the episode runner, over a scripted loop)."""
import threading

import pytest
from prometheus_client import CollectorRegistry

from services.control import EpisodeGate, EpisodeStart, StepPause
from services.errors import PeerUnavailable, ServerLost, StaleLayout, StepLost, UpdateRefused
from services.lifecycle import StatusBoard
from trainer.lm.config import TrainerConfig
from trainer.core.episodes import EpisodeRunner
from trainer.core.loop import StepResult
from trainer.lm.metrics import TrainerMetrics
from trainer.lm.status import TrainerStatus


class ScriptedLoop:
    """Each step answers from ``script``: True a step applied, False one refused, "lost" one lost,
    "ps1" one lost to ps1's loss; ps1 serves again after ``away`` asks of ``returned``."""

    def __init__(self, script, away=0):
        self.script = list(script)
        self.away, self.asked, self.board = away, 0, None
        self.model = self     # the runner leaves the step clock through loop.model.client.clock.end()
        self.client = self.clock = self.losses = self
        self.replica = None
        self.task = self
        self.unit = "tokens"
        self.evaluations, self.layouts, self.followed = [], [], 0

    def ready(self, wait):
        return True

    def step(self, steps=None):
        outcome = self.script.pop(0)
        if outcome == "lost":
            raise StepLost("this step was lost, nothing of it applied: Connection reset by peer")
        if outcome == "ps1":
            raise ServerLost("ps1 went away, and this step was lost (EOF: end of file)", ("ps1",))
        if not outcome:
            raise UpdateRefused("trainer0's update in context 7 is not finite; nothing of it was applied")
        return StepResult(loss=1.0, units=10, seconds=0.01, grad_norm=0.5)

    def end(self):
        pass

    def evaluate(self, closing, advance):
        """A scripted evaluation: ``evaluations`` say what each gives, "stale" a read refused as
        planned with an older layout."""
        outcome = self.evaluations.pop(0)
        if outcome == "stale":
            raise StaleLayout("ps1: dense_params: planned with layout 1, this server serves by layout 2")
        return {"eval": {"loss_sum": outcome, "tokens": 1, "loss": outcome, "ppl": 1.0}}

    def follow_layout(self):
        self.followed += 1
        return self.layouts.pop(0)

    def idle(self):
        pass

    def returned(self, names):
        self.asked += 1
        assert self.board.snapshot()["waiting_for"] == ["ps1"], "the wait is on the status while it lasts"
        return names if self.asked > self.away else []


def runner(script, max_refused=3, away=0, server_wait=600.0, evaluate=False):
    wake = threading.Condition()
    gate = EpisodeGate(wake, "trainer")
    metrics = TrainerMetrics(CollectorRegistry(), "trainer", "trainer0")
    board = StatusBoard("trainer", "trainer0", TrainerStatus)
    cfg = TrainerConfig(name="trainer0", num_ps=1, max_refused_steps=max_refused, server_wait=server_wait)
    loop = ScriptedLoop(script, away)
    loop.board = board
    return EpisodeRunner(loop, cfg, board, metrics, gate, StepPause(wake, gate), wake,
                         evaluate, heartbeat=lambda: None), metrics, board


def test_refused_steps_are_skipped_and_counted():
    run, metrics, board = runner([True, False, "lost", True, False, True, True])
    run.run(EpisodeStart(steps=4))
    assert run.steps == 4 and run.failures.refused == 2 and run.failures.lost == 1
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


def test_a_step_lost_to_a_server_waits_for_it_and_counts_toward_no_limit():
    run, metrics, board = runner([True, "ps1", "ps1", "ps1", True, True], max_refused=2, away=2)
    run.run(EpisodeStart(steps=3))
    assert run.steps == 3 and run.failures.lost == 3 and run.failures.server_losses == 3
    assert run.loop.asked == 2 + 3, "asked until ps1 served again, then once per later loss"
    status = board.snapshot()
    assert status["server_losses"] == 3 and status["lost_steps"] == 3 and status["waiting_for"] == []
    assert metrics.server_losses._value.get() == 3 and metrics.waiting_for_servers._value.get() == 0


def test_a_server_that_does_not_come_back_within_the_wait_stops_the_trainer():
    run, metrics, board = runner([True, "ps1", True], away=10**9, server_wait=0.3)
    with pytest.raises(PeerUnavailable, match=r"ps1 did not come back within 0.3s \(--server-wait\)"):
        run.run(EpisodeStart(steps=3))
    assert board.snapshot()["waiting_for"] == [] and metrics.waiting_for_servers._value.get() == 0


def test_an_evaluation_a_change_of_layout_falls_in_is_read_again_by_the_new_layout():
    run, _, board = runner([True, True], evaluate=True)
    run.loop.evaluations, run.loop.layouts = ["stale", 0.25], [True]
    run.run(EpisodeStart(steps=2))
    assert run.loop.followed == 1 and board.snapshot()["episode"]["done"]


def test_an_evaluation_refused_by_a_layout_that_did_not_change_fails_the_episode():
    run, _, board = runner([True], evaluate=True)
    run.loop.evaluations, run.loop.layouts = ["stale"], [False]
    with pytest.raises(StaleLayout, match="planned with layout 1"):
        run.run(EpisodeStart(steps=1))
    assert not board.snapshot()["episode"]["done"]
