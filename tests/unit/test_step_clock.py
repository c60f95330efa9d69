"""The step clock's rules, without RPC: who may begin, when a sync step closes, what a dead or
leaving trainer does to the others, a checkpoint's freeze, and what the status says."""
from concurrent.futures import Future

import pytest

from ps.clock import StepClock
from ps.consistency import Consistency
from services.errors import BadRequest


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Recorder:
    def __init__(self) -> None:
        self.waits, self.short = [], 0

    def observe_wait(self, seconds):
        self.waits.append(seconds)

    def short_step(self):
        self.short += 1


def make(mode: str, **kw):
    applied = []

    def apply(step, participants, clip, replica_sq):
        applied.append((step, participants, clip))
        return 1.5

    time, metrics = FakeTime(), Recorder()
    clock = StepClock(Consistency.parse(mode), apply=apply, metrics=metrics, now=time, **kw)
    return clock, applied, time, metrics


def begin(clock, name) -> Future:
    f: Future = Future()
    clock.begin(name, f)
    return f


def arrive(clock, name, clip=0.25, refused=False) -> Future:
    f: Future = Future()
    clock.arrive(name, clip, f, refused)
    return f


def test_consistency_parses_the_three_modes_and_refuses_others():
    assert str(Consistency.parse("SYNC")) == "sync" and Consistency.parse("ssp:3").bound == 3
    assert not Consistency.parse("async").clocked and Consistency.parse("ssp:0").clocked
    for bad in ("ssp", "ssp:-1", "ssp:x", "bsp", ""):
        with pytest.raises(ValueError, match="async, sync or ssp:K"):
            Consistency.parse(bad)


def test_sync_step_closes_when_every_member_arrived_and_is_applied_once():
    clock, applied, _, _ = make("sync")
    a, b = begin(clock, "trainer0"), begin(clock, "trainer1")
    assert a.result(0) == 1 and b.result(0) == 1
    first = arrive(clock, "trainer0")
    assert not first.done() and applied == []
    second = arrive(clock, "trainer1", clip=0.5)
    assert applied == [(1, ["trainer0", "trainer1"], 0.25)]   # the smaller clip wins
    assert first.result(0).participants == ("trainer0", "trainer1") and second.result(0).step == 1
    assert begin(clock, "trainer0").result(0) == 2
    assert clock.describe()["step"] == 1


def test_sync_newcomer_joins_an_open_step_nobody_finished_else_the_next():
    clock, applied, _, _ = make("sync")
    begin(clock, "trainer0").result(0)
    assert begin(clock, "trainer1").result(0) == 1, "nobody has arrived: it joins step 1"
    first = arrive(clock, "trainer0")
    late = begin(clock, "trainer2")
    assert not late.done(), "trainer0 finished step 1: the newcomer waits for step 2"
    arrive(clock, "trainer1")
    assert applied == [(1, ["trainer0", "trainer1"], 0.25)] and first.result(0).step == 1 and late.result(0) == 2


def test_sync_dead_trainer_is_dropped_and_the_step_applies_the_arrived_gradients():
    clock, applied, time, metrics = make("sync")
    for n in ("trainer0", "trainer1", "trainer2"):
        begin(clock, n).result(0)
    waiting = [arrive(clock, "trainer0"), arrive(clock, "trainer2")]
    time.t = 12.0
    assert clock.describe()["waiting"] == {"step": 1, "on": ["trainer1"], "seconds": 12.0}
    assert clock.tick().on == ("trainer1",)          # the stall warning names it...
    assert clock.tick() is None                      # ...once per ten seconds
    clock.drop("trainer1")
    assert applied == [(1, ["trainer0", "trainer2"], 0.25)]
    assert all(w.result(0).participants == ("trainer0", "trainer2") for w in waiting)
    assert metrics.short == 1 and metrics.waits == [12.0, 12.0]
    assert clock.describe()["clocks"] == {"trainer0": 1, "trainer2": 1}


def test_sync_trainer_that_arrived_then_died_still_counts():
    clock, applied, _, _ = make("sync")
    begin(clock, "trainer0").result(0)
    begin(clock, "trainer1").result(0)
    arrive(clock, "trainer0")
    clock.drop("trainer0")
    assert applied == []
    arrive(clock, "trainer1").result(0)
    assert applied == [(1, ["trainer0", "trainer1"], 0.25)]


def test_sync_step_goes_on_without_a_refused_update_and_applies_nothing_if_all_were():
    clock, applied, _, metrics = make("sync")
    begin(clock, "good").result(0), begin(clock, "bad").result(0)
    bad = arrive(clock, "bad", clip=0.1, refused=True)
    assert not bad.done(), "a refused trainer still arrived: the step waits for the others"
    arrive(clock, "good").result(0)
    assert applied == [(1, ["good"], 0.25)], "the average is over the accepted updates, with their clip"
    assert bad.result(0).participants == ("good",) and metrics.short == 1
    assert begin(clock, "good").result(0) == 2 and begin(clock, "bad").result(0) == 2
    alone = arrive(clock, "bad", refused=True), arrive(clock, "good", refused=True)
    assert [f.result(0).step for f in alone] == [1, 1] and len(applied) == 1, "nothing applied: step 2 again"
    assert begin(clock, "good").result(0) == 2 and clock.describe()["step"] == 1


def test_ssp_bound_holds_the_fast_trainer_until_the_slowest_catches_up():
    clock, _, _, metrics = make("ssp:1")
    begin(clock, "fast").result(0)
    begin(clock, "slow").result(0)
    arrive(clock, "fast").result(0)
    assert begin(clock, "fast").result(0) == 2, "step 2 needs the slowest to have finished step 0"
    arrive(clock, "fast").result(0)
    held = begin(clock, "fast")
    assert not held.done(), "step 3 needs the slowest to have finished step 1"
    assert clock.describe()["waiting"]["on"] == ["slow"]
    arrive(clock, "slow").result(0)
    assert held.result(0) == 3


def test_ssp_zero_is_a_barrier_per_step_and_a_leaver_releases_it():
    clock, _, _, _ = make("ssp:0")
    begin(clock, "trainer0").result(0)
    begin(clock, "trainer1").result(0)
    arrive(clock, "trainer0").result(0)
    held = begin(clock, "trainer0")
    assert not held.done()
    clock.leave("trainer1")
    assert held.result(0) == 2


def test_freeze_lets_members_finish_the_begun_step_then_parks_them():
    clock, applied, _, _ = make("sync")
    for n in ("trainer0", "trainer1"):
        begin(clock, n).result(0)
    for n in ("trainer0", "trainer1"):
        arrive(clock, n)
    begin(clock, "trainer0").result(0)
    clock.freeze("trainer1")                      # trainer1 has not begun step 2 yet, trainer0 has
    assert clock.describe()["frozen_at"] == 2
    assert begin(clock, "trainer1").result(0) == 2, "step 2 was begun before the freeze: finish it"
    for n in ("trainer0", "trainer1"):
        arrive(clock, n)
    assert applied[-1] == (2, ["trainer0", "trainer1"], 0.25)
    parked = [Future(), Future()]
    nexts = [begin(clock, n) for n in ("trainer0", "trainer1")]
    for n, f in zip(("trainer0", "trainer1"), parked):
        clock.parked(n, f)
    assert all(p.result(0) for p in parked) and not any(f.done() for f in nexts)
    newcomer = begin(clock, "trainer2")
    assert not newcomer.done()
    clock.thaw("trainer1")
    assert [f.result(0) for f in nexts] == [3, 3]
    assert newcomer.result(0) == 3    # nobody has finished step 3: it joins it


def test_a_lost_thaw_lapses():
    clock, _, time, _ = make("ssp:2")
    begin(clock, "trainer0").result(0)
    arrive(clock, "trainer0").result(0)
    clock.freeze("trainer0", seconds=30)
    held = begin(clock, "trainer0")
    assert not held.done()
    time.t = 31.0
    clock.tick()
    assert held.result(0) == 2


def test_protocol_mistakes_are_bad_requests():
    clock, _, _, _ = make("sync")
    with pytest.raises(BadRequest, match="without beginning"):
        arrive(clock, "trainer0")
    begin(clock, "trainer0").result(0)
    with pytest.raises(BadRequest, match="has not arrived"):
        begin(clock, "trainer0")


def test_a_failed_apply_reaches_every_arrival_and_the_step_stays_open():
    def broken(step, participants, clip, replica_sq):
        raise RuntimeError("ps1 is gone")
    clock = StepClock(Consistency.parse("sync"), apply=broken)
    begin(clock, "trainer0").result(0)
    f = arrive(clock, "trainer0")
    with pytest.raises(RuntimeError, match="ps1 is gone"):
        f.result(0)
    assert clock.describe()["step"] == 0 and begin(clock, "trainer0").result(0) == 1


def test_resumed_ssp_clocks_continue_and_sync_counts_on_from_the_servers_step():
    clock, _, _, _ = make("ssp:1", saved={"trainer0": 7, "trainer1": 6})
    assert begin(clock, "trainer0").result(0) == 8
    assert begin(clock, "trainer1").result(0) == 8, "never behind a member already stepping"
    sync, applied, _, _ = make("sync", step=40)
    assert begin(sync, "trainer0").result(0) == 41
    arrive(sync, "trainer0").result(0)
    assert applied == [(41, ["trainer0"], 0.25)]
