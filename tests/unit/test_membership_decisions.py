"""The leader's membership decisions, on a fake clock: who is dead, who may still be joining,
whose hold on the group's token is stuck."""
from __future__ import annotations

from services.membership import ProbeLedger, TokenWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_member_is_dead_after_the_set_number_of_misses_in_a_row():
    ledger = ProbeLedger(failures=2, clock=Clock())
    assert ledger.after_round({"ps1": False, "trainer0": True}) == set()
    assert ledger.after_round({"ps1": True, "trainer0": False}) == set()      # ps1 answered: back to 0
    assert ledger.after_round({"ps1": False, "trainer0": False}) == {"trainer0"}
    assert ledger.after_round({"ps1": False}) == {"ps1"}                      # trainer0 gone from the list
    assert ledger.after_round({"ps1": False, "trainer0": False}) == {"ps1"}   # a new trainer0 starts at 1


def test_a_member_that_just_joined_gets_time_before_a_join_evicts_it():
    clock = Clock()
    ledger = ProbeLedger(failures=2, settle=5.0, clock=clock)
    ledger.seen(["ps1"])
    clock.now += 10
    ledger.seen(["ps1", "trainer3"])                         # trainer3 joined just now
    deadline = clock.now + 5.0
    assert ledger.settled({"ps1", "trainer3"}, deadline) == {"ps1"}
    clock.now += 2
    assert ledger.settled({"trainer3"}, deadline) == set()
    clock.now += 3                                           # settled, and at the deadline anyway
    assert ledger.settled({"trainer3"}, deadline) == {"trainer3"}


def test_a_forgotten_name_is_a_new_member_next_time():
    clock = Clock()
    ledger = ProbeLedger(failures=1, settle=5.0, clock=clock)
    ledger.seen(["trainer0"])
    clock.now += 60
    ledger.forget("trainer0")
    ledger.seen(["trainer0"])                                # the restarted trainer0
    assert ledger.settled({"trainer0"}, deadline=clock.now + 5) == set()


def test_only_one_holder_keeping_the_token_too_long_is_stuck():
    clock = Clock()
    watch = TokenWatch(stuck_after=15.0, clock=clock)
    assert not watch.stuck("")                               # nobody holds it
    assert not watch.stuck("Token_for_trainer1")
    clock.now += 10
    assert not watch.stuck("Token_for_trainer2")             # it changed hands: alive
    clock.now += 14
    assert not watch.stuck("Token_for_trainer2")
    clock.now += 2
    assert watch.stuck("Token_for_trainer2")
    clock.now += 60
    assert not watch.stuck("")                               # freed: nobody's to be stuck


def test_a_silent_member_is_left_to_the_supervisors_deadline_and_a_dead_one_is_not():
    # None: a probe unanswered in time (frozen, cut off); False: refused (dead).
    clock = Clock()
    ledger = ProbeLedger(failures=2, clock=clock, silence=15.0)
    assert ledger.after_round({"ps1": None, "ctr0": False}) == set()
    clock.now += 10
    assert ledger.after_round({"ps1": None, "ctr0": False}) == {"ctr0"}
    clock.now += 4.9
    assert ledger.after_round({"ps1": None}) == set()
    clock.now += 0.2
    assert ledger.after_round({"ps1": None}) == {"ps1"}
    assert ledger.after_round({"ps1": True}) == set(), "an answer ends its silence"
    assert ledger.after_round({"ps1": None}) == set()
    # Without a supervisor's deadline, silence is a miss like any other.
    alone = ProbeLedger(failures=2, clock=clock)
    assert alone.after_round({"ps1": None}) == set() and alone.after_round({"ps1": None}) == {"ps1"}
