"""The reshard bench's reading of the trainers' counters (``trainer/ctr/bench_reshard.py``): the
figures it prints come from these, so they are checked on counters read at known times."""
import pytest

from trainer.ctr.bench_reshard import Counters


def _counters(seen: dict[str, list[tuple[float, int]]], period: float = 0.1) -> Counters:
    c = Counters({}, period)
    c.seen = seen
    return c


def test_a_trainer_held_for_a_second_shows_as_its_longest_still_time():
    steady = [(t / 10, t) for t in range(0, 50)]                       # a step each read, 0.0..4.9 s
    held = [(t / 10, t) for t in range(0, 20)] + [(2.0 + k / 10, 19) for k in range(1, 10)] \
        + [(3.0 + k / 10, 20 + k) for k in range(0, 20)]                 # still from 1.9 s to 3.0 s
    c = _counters({"ctr0": steady, "ctr1": held})
    assert abs(c.longest_still(1.5, 3.5) - 1.1) < 1e-9
    assert abs(c.longest_still(3.5, 4.5) - 0.1) < 1e-9              # after the hold: a read a step
    # the hold began before the window: measured from the last step seen before it
    assert abs(c.longest_still(2.5, 3.5) - 1.1) < 1e-9


def test_steps_and_the_median_step_over_a_window():
    fast = [(t / 10, t) for t in range(0, 41)]                        # 10 steps/s
    slow = [(t / 10, t // 2) for t in range(0, 41)]                   # 5 steps/s
    c = _counters({"ctr0": fast, "ctr1": slow})
    assert c.steps_between(1.0, 3.0) == 20 + 10
    assert abs(c.median_step(1.0, 3.0) - 0.15) < 1e-9                # the median of 0.1 and 0.2
    assert c.median_step(5.0, 6.0) is None                             # nothing read there


def test_a_hold_longer_than_the_window_ends_at_the_first_step_after_it():
    held = [(t / 10, min(t, 10)) for t in range(0, 40)] + [(4.0, 11)]  # still from 1.0 s to 4.0 s
    assert abs(_counters({"ctr0": held}).longest_still(1.5, 3.0) - 3.0) < 1e-9


def test_the_wait_for_a_step_after_a_hold_returns_once_every_trainer_stepped():
    c = _counters({"ctr0": [(0.0, 1), (1.0, 1), (2.0, 2)], "ctr1": [(0.0, 5), (2.5, 6)]})
    c.stepped_after(1.5, 1.0)                                    # both moved after 1.5 s
    c.seen["ctr1"] = [(0.0, 5), (1.2, 6), (2.5, 6)]               # ctr1's last step was before
    with pytest.raises(RuntimeError, match="did not step"):
        c.stepped_after(1.5, 0.2)
