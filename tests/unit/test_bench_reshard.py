"""The reshard bench's reading of the trainers' counters (``trainer/ctr/bench_reshard.py``): the
figures it prints come from these, so they are checked on counters read at known times."""
import pytest

import argparse

import torch

from trainer.ctr.bench_reshard import Counters, _refused, links, same_model, within_link


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


def test_a_move_is_judged_against_its_bytes_over_a_capped_link():
    # 125 MB over 1 Gbit/s is 1 s: a move may take 1.5 s plus 5 s, and no more.
    used = {"ps0": {"tx": 100e6, "cpu_s": 6.0}, "ps1": {"tx": 60e6, "cpu_s": 4.0}, "ctr0": {"tx": 5e6, "cpu_s": 6.0}}
    link = links(used, 8.0, "1gbit", 125_000_000)
    assert link["busiest"] == "ps0" and link["busiest_mean_bytes_per_s"] == 12_500_000
    assert link["cores_used"] == 2.0 and link["cpu_s"]["ctr0"] == 6.0     # the 2 cores busy: CPU bounded it
    assert abs(link["moved_over_link_s"] - 1.0) < 1e-9
    assert within_link({"move_s": 6.5, "link": link}) is True
    assert within_link({"move_s": 6.6, "link": link}) is False
    # on local processes, or hosts without a cap, there is no link to judge a move by
    assert links({}, 8.0, "1gbit", 125_000_000) is None and within_link({"move_s": 1.0, "link": None}) is None
    uncapped = links({"ps0": {"tx": 10.0, "cpu_s": 0.5}}, 1.0, None, 125_000_000)
    assert uncapped["moved_over_link_s"] is None and within_link({"move_s": 1.0, "link": uncapped}) is None


def test_two_exported_models_are_the_same_only_bit_for_bit():
    def model(bump: float = 0.0, extra: bool = False):
        tables = {"weights.t0": torch.arange(12.0).reshape(6, 2), "weights.t1": {"ids": torch.tensor([7, 3]),
                                                                                "rows": torch.ones(2, 2)}}
        tables["weights.t0"][4, 1] += bump
        dense = {"top.weight": torch.full((2, 2), 0.5), **({"top.bias": torch.zeros(2)} if extra else {})}
        return {"format": 1, "tables": tables, "dense": dense}
    same = same_model(model(), model(), steps=10)
    assert same["bit_identical"] and same["tensors"] == 4 and same["values"] == 12 + 2 + 4 + 4
    one_ulp = same_model(model(), model(bump=1e-6), steps=10)                 # 9.0 and 9.000001
    assert not one_ulp["bit_identical"] and one_ulp["first_differing"] == ["tables/weights.t0"]
    assert same_model(model(), model(extra=True), steps=10)["first_differing"] == ["dense/top.bias"]


def test_a_comparison_is_refused_where_two_runs_would_differ_anyway_and_counts_where_updates_are_averaged():
    def ns(**kw):
        return argparse.Namespace(**{"emulate_hosts": False, "host_cpus": None, "link_rate": None,
                                     "compare_steps": 100, "consistency": "sync", "trainers": 2,
                                     "count_updates": False, **kw})
    assert _refused(ns()) is None and _refused(ns(consistency="async", trainers=1)) is None
    assert "come in no fixed order" in _refused(ns(consistency="async"))
    assert "at least 1" in _refused(ns(compare_steps=0))
    assert "settings of --emulate-hosts" in _refused(ns(link_rate="1gbit"))
    assert "averages" in _refused(ns(count_updates=True))
    assert _refused(ns(count_updates=True, consistency="ssp:1", compare_steps=None, trainers=3)) is None
