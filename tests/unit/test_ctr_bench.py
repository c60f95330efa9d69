"""`rpcps bench ctr`'s CPU account, without a cluster: a process's CPU read from /proc as the
kernel counts it, and a sample's CPU from the members' readings while every trainer trains."""
import os
import time

import pytest

from trainer.ctr.bench import _cpu_seconds, _sample, cpu_account


def test_a_process_cpu_from_proc_is_what_it_used():
    start, wall = _cpu_seconds(os.getpid()), time.process_time()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:      # burn 0.3 s of CPU
        sum(range(1000))
    used, measured = _cpu_seconds(os.getpid()) - start, time.process_time() - wall
    assert used == pytest.approx(measured, abs=0.05), (used, measured)


def test_a_samples_cpu_counts_only_the_stretch_every_trainer_trained(tmp_path):
    training = {}
    assert cpu_account(training, 100) is None, "no sample while training: no account"
    first = {"cpu": {"ps0": 1.0, "ctr0": 2.0, "ctr1": 2.0}, "at": 10.0, "cpu_steps": 4}
    training.update(first=first, cpu={"ps0": 1.5, "ctr0": 4.0, "ctr1": 4.5}, at=12.0, cpu_steps=14)
    found = cpu_account(training, 100)          # 10 steps of 100 samples; 0.5 s of servers, 4.5 s of trainers
    assert found["servers_us_per_sample"] == pytest.approx(500.0)
    assert found["trainers_us_per_sample"] == pytest.approx(4500.0)
    assert found["us_per_sample"] == pytest.approx(5000.0)
    assert found["cores_busy"] == pytest.approx(2.5)
    assert cpu_account({**training, "cpu_steps": 4}, 100) is None, "no step between the readings"
    _sample(tmp_path, {}, training)             # no cluster.json yet: nothing read, nothing changed
    assert training["cpu_steps"] == 14


def _variant(samples_per_s, auc, **more):
    return {"samples_per_s": samples_per_s, "auc": auc, "logloss": 0.5, "rss_mb": 100, "bytes_per_sample": 800.0,
            "saved_bytes_per_sample": 0.0, "allreduce_bytes_per_sample": 0.0, "account": {}, "cache_hit_rate": None,
            "cpu": {"us_per_sample": 1e6 / samples_per_s}, **more}


def test_the_summary_takes_medians_and_ratios_within_each_round_and_says_which_targets_were_met():
    from trainer.ctr.bench import TARGETS, _medians, _met, _ratios
    rounds = [{"local": _variant(100, 0.70), "async": _variant(90, 0.69), "sync": _variant(60, 0.70)},
              {"local": _variant(50, 0.72), "async": _variant(40, 0.71), "sync": _variant(30, 0.72)},
              {"local": _variant(80, 0.70), "async": _variant(70, 0.69), "sync": _variant(50, 0.70)}]
    results = {name: _medians(name, rounds, True) for name in ("local", "async", "sync")}
    assert results["async"]["samples_per_s"] == 70 and results["local"]["rss_mb"] == 100
    # Ratios are taken round by round, then their median: 0.9, 0.8, 0.875.
    assert results["async"]["cpu"]["vs_local"] == pytest.approx(80 / 70)      # median of 100/90, 50/40, 80/70
    ratios = _ratios(results, rounds, 400.0)
    assert ratios["async_vs_local"] == pytest.approx(0.875) and ratios["sync_auc_minus_local"] == 0.0
    assert ratios["async_bytes_vs_rows"] == 2.0
    met = _met(results, ratios)
    assert met == {"async_vs_local": 0.875 >= TARGETS["async_vs_local"], "sync_auc_minus_local": True}
