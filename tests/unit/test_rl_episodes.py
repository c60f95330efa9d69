"""The agent's bookkeeping of one episode, without RPC: reports, losses, late and stale answers."""
from __future__ import annotations

import threading

import pytest

from trainer.rl.batching import ActionBatcher
from trainer.rl.episodes import Episode
from trainer.rl.service import EpisodeReport


class FakeLearner:
    def __init__(self) -> None:
        self.rewarded: dict[str, list[float]] = {}
        self.dropped: list[str] = []

    def reward(self, name: str, rewards: list[float]) -> None:
        self.rewarded[name] = list(rewards)

    def drop(self, name: str) -> None:
        self.dropped.append(name)


@pytest.fixture
def parts():
    wake = threading.Condition()
    learner, batcher = FakeLearner(), ActionBatcher(lambda requests: [0] * len(requests))
    lost: list[tuple[str, str]] = []
    return wake, learner, batcher, lost


def episode_of(parts, observers, number=1) -> Episode:
    wake, learner, batcher, lost = parts
    return Episode(number, observers, learner, batcher, wake, lambda o, why: lost.append((o, why)))


def report(name: str, steps: int = 3) -> EpisodeReport:
    return EpisodeReport(name, steps, [1.0] * steps, float(steps))


def test_reports_are_learned_from_and_the_batch_stops_waiting_for_finished_observers(parts):
    _, learner, batcher, lost = parts
    episode = episode_of(parts, ["observer0", "observer1"])
    assert batcher.waiting_for == ["observer0", "observer1"]
    episode.finish("observer0", report("observer0"))
    assert learner.rewarded == {"observer0": [1.0, 1.0, 1.0]}
    assert batcher.waiting_for == ["observer1"] and not episode.playing("observer0")
    episode.finish("observer1", report("observer1", 5))
    assert sorted(episode.reports) == ["observer0", "observer1"] and lost == []
    episode.wait(lambda: False, lambda: ["observer0", "observer1"], stop_wait=1.0)   # over: returns at once


def test_a_lost_observer_is_counted_once_and_its_late_report_ignored(parts):
    _, learner, batcher, lost = parts
    episode = episode_of(parts, ["observer0", "observer1"])
    episode.lose("observer1", "connection reset")
    episode.lose("observer1", "removed from the group")        # the listener hears of it too
    episode.finish("observer1", report("observer1"))           # and then its answer arrives
    assert lost == [("observer1", "connection reset")]
    assert learner.dropped == ["observer1"] and "observer1" not in learner.rewarded
    assert episode.lost == ["observer1"] and "observer1" not in episode.reports
    assert batcher.waiting_for == ["observer0"]


def test_waiting_drops_observers_that_are_no_longer_members(parts):
    _, _, _, lost = parts
    episode = episode_of(parts, ["observer0", "observer1"])
    episode.finish("observer0", report("observer0"))
    episode.wait(lambda: False, lambda: ["agent", "observer0"], stop_wait=1.0)
    assert lost == [("observer1", "no longer a member")]


def test_a_stopping_agent_waits_a_bounded_time_then_gives_up_on_the_rest(parts):
    _, _, _, lost = parts
    episode = episode_of(parts, ["observer0"])
    episode.wait(lambda: True, lambda: ["agent", "observer0"], stop_wait=0.0)
    assert lost == [("observer0", "the agent is stopping and waited long enough")]


def test_a_report_from_another_thread_wakes_the_waiting_agent(parts):
    episode = episode_of(parts, ["observer0"])
    answer = threading.Timer(0.05, episode.finish, args=("observer0", report("observer0")))
    answer.start()
    episode.wait(lambda: False, lambda: ["agent", "observer0"], stop_wait=1.0)
    assert list(episode.reports) == ["observer0"]


def test_a_new_episode_refuses_the_previous_ones_leftover_states(parts):
    _, _, batcher, _ = parts
    episode_of(parts, ["observer0", "observer1"])
    left = batcher.submit("observer0", [0.0] * 4)              # waits for observer1, who never sends
    episode_of(parts, ["observer0"], number=2)
    with pytest.raises(Exception, match="has ended"):
        left.wait()
