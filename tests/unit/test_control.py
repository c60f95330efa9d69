"""The episode gate and the checkpoint's step pause, between real threads: a sidecar or RPC thread
on one side, a role's loop on the other."""
from __future__ import annotations

import threading

import pytest

from services.control import EpisodeGate, EpisodeStart, StepPause
from services.errors import EpisodeConflict, NotReady
from tests.support.wait import wait_until

READY = (True, "ready")


@pytest.fixture
def wake() -> threading.Condition:
    return threading.Condition(threading.Lock())


class Loop(threading.Thread):
    """A role's loop: waits for an episode, then steps until stopped, at a boundary each step."""

    def __init__(self, gate: EpisodeGate, pause: StepPause, wake: threading.Condition) -> None:
        super().__init__(daemon=True)
        self.gate, self.pause, self.wake = gate, pause, wake
        self.steps = 0
        self.episodes: list[EpisodeStart] = []
        self.step_allowed = threading.Semaphore(0)   # the test lets each step happen

    def run(self) -> None:
        while (request := self.gate.next(lambda: None)) is not None:
            self.episodes.append(request)
            while True:
                with self.wake:
                    self.pause.boundary()
                    if self.gate.stop_requested or self.gate.closing:
                        break
                if not self.step_allowed.acquire(timeout=10):
                    break
                self.steps += 1
            self.gate.finish()


@pytest.fixture
def loop(wake):
    gate = EpisodeGate(wake, "trainer")
    running = Loop(gate, StepPause(wake, gate), wake)
    running.start()
    yield running
    gate.close()
    running.step_allowed.release(100)
    running.join(10)
    assert not running.is_alive()


def test_an_episode_is_started_once_and_stopped_at_a_boundary(loop):
    with pytest.raises(NotReady, match="trainer not ready: joining"):
        loop.gate.start(EpisodeStart(steps=5), (False, "joining"))
    loop.gate.start(EpisodeStart(steps=5), READY)
    with pytest.raises(EpisodeConflict, match="already running"):
        loop.gate.start(EpisodeStart(steps=5), READY)
    wait_until(lambda: loop.gate.running, 10, "the episode to run")
    loop.step_allowed.release(3)
    wait_until(lambda: loop.steps == 3, 10, "three steps")
    assert loop.gate.stop() is True
    loop.step_allowed.release()            # the step in flight ends, then the boundary sees the stop
    wait_until(lambda: not loop.gate.running, 10, "the episode to end")
    assert loop.steps <= 4
    with pytest.raises(EpisodeConflict, match="no episode is running"):
        loop.gate.stop()


def test_a_start_not_yet_picked_up_is_cancelled_by_a_stop(wake):
    gate = EpisodeGate(wake, "agent")        # no loop takes it
    gate.start(EpisodeStart(episodes=2), READY)
    assert gate.stop() is False
    assert gate.pending is None


def test_a_hold_waits_for_the_step_in_flight_and_keeps_the_loop_until_released(loop):
    loop.gate.start(EpisodeStart(), READY)
    wait_until(lambda: loop.gate.running, 10, "the episode to run")
    held = []
    holder = threading.Thread(target=lambda: held.append(loop.pause.hold(10)))
    holder.start()
    loop.step_allowed.release()               # finish the step in flight: the next boundary holds
    holder.join(10)
    assert held == [True]
    at_hold = loop.steps
    loop.step_allowed.release(5)               # permission to step, but the loop is held
    with pytest.raises(AssertionError):
        wait_until(lambda: loop.steps > at_hold, 0.5, "a step while held")
    loop.pause.release()
    wait_until(lambda: loop.steps >= at_hold + 5, 10, "steps after the release")


def test_a_hold_that_times_out_leaves_the_loop_free(loop):
    loop.gate.start(EpisodeStart(), READY)
    wait_until(lambda: loop.gate.running, 10, "the episode to run")
    assert loop.pause.hold(0.2) is False        # the step in flight never ends in time
    loop.step_allowed.release(3)
    wait_until(lambda: loop.steps >= 3, 10, "steps after the failed hold")


def test_an_idle_or_quiet_loop_counts_as_held(wake):
    gate = EpisodeGate(wake, "trainer")
    pause = StepPause(wake, gate)
    assert pause.hold(0.1) is True              # no episode runs
    pause.release()
    with wake:
        gate.running = True                     # an episode whose loop is evaluating
    with pause.quiet():
        assert pause.hold(0.1) is True
    pause.release()
    assert pause.hold(0.1) is False             # running, not quiet, never at a boundary


def test_a_stop_wakes_a_held_loop(loop):
    loop.gate.start(EpisodeStart(), READY)
    wait_until(lambda: loop.gate.running, 10, "the episode to run")
    holder = threading.Thread(target=loop.pause.hold, args=(10,))
    holder.start()
    loop.step_allowed.release()
    holder.join(10)
    loop.gate.close()                           # held, never released: the close still ends it
    loop.join(10)
    assert not loop.is_alive()
