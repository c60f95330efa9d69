"""The agent's learning and batching without RPC: same actions batched or not, reproducible runs,
REINFORCE changes the policy, checkpoints round-trip, the batcher waits for exactly who is playing."""
import random

import pytest
import torch

from services.errors import BadRequest
from trainer.rl.batching import ActionBatcher
from trainer.rl.policy import Learner, LearnerConfig

NAMES = ["observer0", "observer1", "observer2"]


def states(rng):
    return {n: [rng.uniform(-0.2, 0.2) for _ in range(4)] for n in NAMES}


def test_batched_and_one_at_a_time_choose_the_same_actions():
    batched, single = Learner(LearnerConfig(seed=7)), Learner(LearnerConfig(seed=7))
    rng = random.Random(0)
    for step in range(200):
        s = states(rng)
        together = dict(zip(NAMES, batched.act([(n, s[n]) for n in NAMES])))
        order = NAMES[step % 3:] + NAMES[:step % 3]          # arrival order must not matter
        alone = {n: single.act([(n, s[n])])[0] for n in order}
        assert together == alone, step


def test_runs_repeat_with_a_seed_and_differ_without():
    def play(seed):
        learner, rng, out = Learner(LearnerConfig(seed=seed)), random.Random(1), []
        for _ in range(100):
            s = states(rng)
            out += learner.act([(n, s[n]) for n in NAMES])
        return out
    assert play(3) == play(3)
    assert play(3) != play(4)


def _episode(learner, rng, steps=30, reward=lambda a: 1.0):
    for _ in range(steps):
        s = states(rng)
        actions = learner.act([(n, s[n]) for n in NAMES])
        for n, a in zip(NAMES, actions):
            learner.reward(n, [reward(a)])
    return learner.finish_episode()


def test_reinforce_learns_a_rewarded_action():
    learner, rng = Learner(LearnerConfig(seed=2, dropout=0.0)), random.Random(2)
    before = [p.clone() for p in learner.policy.parameters()]
    first = _episode(learner, rng, reward=lambda a: float(a == 1))
    assert first.episode == 1 and first.steps == 90 and set(first.rewards) == set(NAMES)
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.policy.parameters()))
    for _ in range(40):
        last = _episode(learner, rng, reward=lambda a: float(a == 1))
    assert last.reward > first.reward + 5, (first.reward, last.reward)   # action 1 is now preferred
    assert 0 < learner.running_reward < last.reward


def test_a_dropped_or_incomplete_trajectory_is_not_learned_from():
    learner, rng = Learner(LearnerConfig(seed=2)), random.Random(2)
    s = states(rng)
    learner.act([(n, s[n]) for n in NAMES])
    learner.reward("observer0", [1.0])
    learner.reward("observer1", [1.0])      # observer2 never reports: incomplete
    learner.drop("observer1")               # observer1 died
    result = learner.finish_episode()
    assert set(result.rewards) == {"observer0"} and result.steps == 1
    assert learner.finish_episode() is None  # nothing recorded since


def test_checkpoint_state_round_trips_and_acts_the_same_afterwards():
    learner, rng = Learner(LearnerConfig(seed=5)), random.Random(5)
    for _ in range(3):
        _episode(learner, rng)
    copy = Learner(LearnerConfig(seed=99))
    copy.load(learner.state())
    assert (copy.episodes, copy.running_reward) == (learner.episodes, learner.running_reward)
    s = states(rng)
    assert copy.act([(n, s[n]) for n in NAMES]) == learner.act([(n, s[n]) for n in NAMES])
    with pytest.raises(ValueError, match="hidden units"):
        Learner(LearnerConfig(hidden=64)).load(learner.state())


def test_the_batcher_answers_when_everyone_playing_has_asked():
    calls = []

    def act(requests):
        calls.append([n for n, _ in requests])
        return [i for i, _ in enumerate(requests)]
    b = ActionBatcher(act)
    b.begin(NAMES)
    f2 = b.submit("observer2", [0.0] * 4)
    f0 = b.submit("observer0", [0.0] * 4)
    assert not f2.done() and b.waiting_for == ["observer1"]
    b.leave("observer1")                                    # its episode ended: nobody waits for it
    assert calls == [["observer0", "observer2"]] and (f0.wait(), f2.wait()) == (0, 1)
    with pytest.raises(BadRequest, match="not taking part"):
        b.submit("observer1", [0.0] * 4).wait()
    f0 = b.submit("observer0", [0.0] * 4)
    with pytest.raises(BadRequest, match="already has a state waiting"):
        b.submit("observer0", [0.0] * 4).wait()
    b.begin(["observer0"])                                   # a new episode: the old request is refused
    with pytest.raises(BadRequest, match="has ended"):
        f0.wait()
    assert b.batches == 1 and b.requests == 2


@pytest.mark.parametrize("kind,length", [("fixed:7", 7), ("CartPole-v1:300", 300)])
def test_fixed_length_environments_end_after_exactly_n_steps(kind, length):
    from trainer.rl.env import make_env, threshold
    env = make_env(kind)
    env.reset(seed=0)
    ends = [env.step(0)[2:4] for _ in range(length)]      # always pushing left: CartPole falls often
    assert ends[-1] == (False, True) and all(e == (False, False) for e in ends[:-1])
    assert threshold(kind) == length - 0.5


def test_unknown_environment_is_refused():
    from trainer.rl.env import make_env
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("Pong-v5")
