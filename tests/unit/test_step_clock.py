"""The step clock's rules, without RPC: who may begin, when a sync step closes, what a dead or
leaving trainer does to the others, a checkpoint's freeze, and what the status says."""
from concurrent.futures import Future

import pytest

from ps.leader.clock import StepClock
from ps.leader.clock.pace import START_WAIT_SECONDS
from ps.spec.consistency import Consistency
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


class StepOf(Future):
    """A begin's answer as the step number only: what most rules here are about."""

    def set_result(self, granted):
        super().set_result(granted.step)


def begin(clock, name) -> Future:
    f: Future = StepOf()
    clock.begin(name, f)
    return f


def lockstep(clock, name, start_with=2) -> Future:
    f: Future = Future()
    clock.begin(name, f, start_with, lockstep=True)
    return f


def arrive(clock, name, clip=0.25, refused=False, broken=False) -> Future:
    f: Future = Future()
    clock.arrive(name, clip, f, refused, broken=broken)
    return f


def test_consistency_parses_the_four_modes_and_refuses_others():
    assert str(Consistency.parse("SYNC")) == "sync" and Consistency.parse("ssp:3").bound == 3
    assert not Consistency.parse("async").clocked and Consistency.parse("ssp:0").clocked
    hybrid = Consistency.parse(" Hybrid ")
    assert str(hybrid) == "hybrid" and hybrid.clocked and not hybrid.averaged and not hybrid.bounded
    assert hybrid.dense_modes == ("allreduce",) and Consistency.parse("sync").dense_modes == ("ps", "allreduce")
    for bad in ("ssp", "ssp:-1", "ssp:x", "bsp", ""):
        with pytest.raises(ValueError, match="async, sync, hybrid or ssp:K"):
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


def test_ssp_counts_the_steps_a_trainer_reads_ahead_toward_the_bound():
    clock, _, _, _ = make("ssp:2")

    def reading_ahead(name):
        f: Future = StepOf()
        clock.begin(name, f, 0, 1)            # its step reads the rows of the step after it too
        return f
    reading_ahead("fast").result(0)
    begin(clock, "slow").result(0)
    arrive(clock, "fast").result(0)
    assert reading_ahead("fast").result(0) == 2, "1 step ahead of the slowest, its reads 2: within the bound"
    arrive(clock, "fast").result(0)
    held = reading_ahead("fast")
    assert not held.done(), "2 steps ahead, its reads 3: staler than ssp:2 allows"
    arrive(clock, "slow").result(0)
    assert held.result(0) == 3
    with pytest.raises(BadRequest, match="prefetch at most 2 steps"):
        clock.begin("late", StepOf(), 0, 3)
    sync, _, _, _ = make("sync")
    with pytest.raises(BadRequest, match="nothing is read ahead"):
        sync.begin("trainer0", StepOf(), 0, 1)


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


def test_sync_first_step_waits_for_the_trainers_the_job_starts_with():
    clock, applied, _, _ = make("sync", step=40)
    first = StepOf()
    clock.begin("trainer1", first, 2)
    assert not first.done(), "the job starts with two trainers: one alone does not train a step"
    assert clock.describe()["waiting"]["on"] == ["1 more of the trainers the job starts with"]
    second = StepOf()
    clock.begin("trainer0", second, 2)
    assert first.result(0) == second.result(0) == 41
    step_all(clock, ["trainer0", "trainer1"])
    assert applied == [(41, ["trainer0", "trainer1"], 0.25)]
    # Once the job runs, a newcomer joins as before, and one that says nothing never waits.
    late = StepOf()
    clock.begin("trainer2", late, 3)
    assert late.result(0) == 42
    # Every member gone (one waits for data, the others died): the job has begun, and whoever
    # comes back steps without waiting for the trainers it started with.
    for name in ("trainer0", "trainer1", "trainer2"):
        clock.leave(name)
    back = StepOf()
    clock.begin("trainer1", back, 3)
    assert back.done() and back.result(0) == 42 and clock.describe().get("waiting") is None
    alone, _, _, _ = make("sync")
    assert begin(alone, "trainer0").result(0) == 1


def test_sync_first_step_begins_without_a_trainer_that_never_comes(caplog):
    clock, applied, time, _ = make("sync")
    waiting = [StepOf() for _ in range(2)]
    for k, f in enumerate(waiting):
        clock.begin(f"trainer{k}", f, 3)
    time.t = START_WAIT_SECONDS - 1
    clock.tick()
    assert not any(f.done() for f in waiting)
    time.t = START_WAIT_SECONDS
    clock.tick()
    assert [f.result(0) for f in waiting] == [1, 1]
    assert "step 1 begins with 2 of the 3 trainers the job starts with" in caplog.text
    step_all(clock, ["trainer0", "trainer1"])
    assert applied == [(1, ["trainer0", "trainer1"], 0.25)]


# --- lockstep: trainers that all-reduce replicated weights (--dense allreduce) ---------------------

def test_lockstep_first_step_waits_for_the_starting_count_then_begins_for_all_at_once():
    clock, _, _, _ = make("sync")
    a = lockstep(clock, "trainer1")
    assert not a.done(), "the job starts with two trainers: one alone does not begin"
    b = lockstep(clock, "trainer0")
    assert a.result(0) == b.result(0)
    assert a.result(0).step == 1 and a.result(0).group == ("trainer0", "trainer1") and a.result(0).group_key
    assert clock.describe()["group"] == {"generation": 1, "members": ["trainer0", "trainer1"]}


def step_all(clock, names, refused=(), broken=()):
    waits = [arrive(clock, n, refused=n in refused, broken=n in broken) for n in names]
    return [w.result(0) for w in waits]


def test_lockstep_keeps_its_key_while_the_group_stays_and_a_newcomer_waits_for_the_boundary():
    clock, applied, _, _ = make("sync")
    first = [lockstep(clock, n) for n in ("trainer0", "trainer1")]
    key = first[0].result(0).group_key
    newcomer = lockstep(clock, "trainer2")
    assert not newcomer.done(), "step 1 has begun: the newcomer takes part from step 2"
    step_all(clock, ["trainer0", "trainer1"])
    assert applied[-1][:2] == (1, ["trainer0", "trainer1"])
    second = lockstep(clock, "trainer0")
    assert not second.done() and not newcomer.done(), "step 2 begins once trainer1 asks too"
    assert clock.describe()["waiting"]["on"] == ["trainer1"]
    third = lockstep(clock, "trainer1")
    grants = [f.result(0) for f in (second, third, newcomer)]
    assert {g.step for g in grants} == {2} and {g.group for g in grants} == {("trainer0", "trainer1", "trainer2")}
    assert len({g.group_key for g in grants}) == 1 and grants[0].group_key != key

    step_all(clock, ["trainer0", "trainer1", "trainer2"])
    again = [lockstep(clock, n) for n in ("trainer0", "trainer1", "trainer2")]
    assert {f.result(0).group_key for f in again} == {grants[0].group_key}, "same members, same group"


def test_lockstep_a_dead_member_gives_the_survivors_a_new_group_at_the_same_step():
    clock, applied, _, _ = make("sync")
    grants = [lockstep(clock, n, 3) for n in ("trainer0", "trainer1", "trainer2")]
    key = grants[0].result(0).group_key
    # trainer1 dies inside the all-reduce: the others' step fails there, and they say so.
    waits = [arrive(clock, n, refused=True, broken=True) for n in ("trainer0", "trainer2")]
    assert not any(w.done() for w in waits)
    clock.drop("trainer1")
    assert [w.result(0).participants for w in waits] == [(), ()] and applied == [], "nothing of step 1 applied"
    survivors = [lockstep(clock, n, 3) for n in ("trainer0", "trainer2")]
    got = [f.result(0) for f in survivors]
    assert {g.step for g in got} == {1}, "step 1 again, for the survivors"
    assert {g.group for g in got} == {("trainer0", "trainer2")} and got[0].group_key != key


def test_lockstep_a_broken_group_is_formed_anew_even_with_the_same_members():
    clock, _, _, _ = make("sync")
    key = [lockstep(clock, n) for n in ("trainer0", "trainer1")][0].result(0).group_key
    step_all(clock, ["trainer0", "trainer1"], refused=["trainer1"], broken=["trainer1"])
    again = [lockstep(clock, n) for n in ("trainer0", "trainer1")]
    assert again[0].result(0).group == ("trainer0", "trainer1") and again[0].result(0).group_key != key


def test_lockstep_and_plain_trainers_cannot_share_a_clock():
    clock, _, _, _ = make("sync")
    lockstep(clock, "trainer0", 1).result(0)
    with pytest.raises(BadRequest, match="every trainer of a job needs the same --dense"):
        begin(clock, "trainer1")
    ssp, _, _, _ = make("ssp:1")
    with pytest.raises(BadRequest, match="need --consistency sync or hybrid"):
        lockstep(ssp, "trainer0")
    hybrid, _, _, _ = make("hybrid")
    with pytest.raises(BadRequest, match="keeps the dense weights replicated on the trainers"):
        begin(hybrid, "trainer0")


def test_hybrid_steps_in_lockstep_and_closes_a_step_without_applying_anything():
    clock, applied, time, metrics = make("hybrid")
    first = [lockstep(clock, n) for n in ("trainer0", "trainer1")]
    assert [f.result(0).step for f in first] == [1, 1] and first[0].result(0).group == ("trainer0", "trainer1")
    time.t = 1.0
    early = arrive(clock, "trainer0")
    assert early.result(0).step == 1, "nothing of the close is news: the arrival is answered at once"
    again = lockstep(clock, "trainer0")
    assert not again.done() and clock.step == 0, "the step closes once every member arrived"
    assert clock.describe()["waiting"] == {"step": 1, "on": ["trainer1"], "seconds": 0.0}
    time.t = 3.0
    # trainer1's rows were refused: still a step of the replicas, counted by the clock.
    assert arrive(clock, "trainer1", refused=True).result(0).step == 1 and clock.step == 1
    assert not again.done(), "lockstep: the next step begins for both at once"
    other = lockstep(clock, "trainer1")
    assert again.result(0).step == other.result(0).step == 2 and clock.step == 1
    assert applied == [], "each trainer applied its own rows: the clock applies nothing"
    # A trainer's wait is at its begin: the first grants (0 s) and trainer0's 2 s for trainer1.
    assert metrics.waits == [0.0, 0.0, 2.0, 0.0]


def test_lockstep_freeze_holds_every_member_and_the_group_at_the_boundary():
    clock, _, _, _ = make("sync")
    assert all(f.result(0) for f in [lockstep(clock, n) for n in ("trainer0", "trainer1")])
    clock.freeze("ps0")
    step_all(clock, ["trainer0", "trainer1"])
    parked = []
    for n in ("trainer0", "trainer1"):
        f: Future = Future()
        clock.parked(n, f)
        parked.append(f)
    nexts = [lockstep(clock, n) for n in ("trainer0", "trainer1")]
    assert all(p.result(0) for p in parked) and not any(f.done() for f in nexts)
    clock.thaw("ps0")
    assert [f.result(0).step for f in nexts] == [2, 2]
