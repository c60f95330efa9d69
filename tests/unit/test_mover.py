"""The leader's changes of layout with fakes for the servers: what each is asked, in which order,
the trainers held around it, and a change that waits for its servers to serve."""
import threading

import pytest

from ps.leader.moves import Mover, by_destination
from ps.spec.sharding import Slots
from ps.spec.surface import MoveSurface
from services.errors import BadRequest, NotReady, PeerUnavailable
from tests.support.wait import wait_until


class Fakes:
    def __init__(self, members):
        self.slots = Slots.even(2, 12)
        self.members = list(members)
        self.calls: list[tuple] = []
        self.timeouts: list[tuple] = []
        self.evicted: list[tuple] = []
        self.held = False
        self.fail_ahead = False
        self.done = threading.Event()

    def paused(self, action):
        self.held = True
        try:
            return action(), 0.01
        finally:
            self.held = False

    def call(self, to, method, *args, timeout=None):
        ahead = method is MoveSurface.prepare or (method is MoveSurface.take_part and args[-1] == "early")
        if ahead and self.fail_ahead:
            raise ConnectionError(f"{to} is unreachable")
        assert self.held != (ahead or method is MoveSurface.retire), \
            f"{method.__name__} {'outside' if not self.held else 'inside'} the trainers' hold"
        self.calls.append((to, method.__name__, *args, self.held))
        self.timeouts.append((method.__name__, args[-1] if method is MoveSurface.take_part else None, timeout))
        return 100 if method is MoveSurface.take_part else {}

    def adopt(self, slots):
        self.slots = slots

    def mover(self):
        return Mover(lambda: self.slots, self.adopt, self.paused, lambda names, why: self.evicted.append((names, why)),
                     lambda: self.members, self.call, ended=lambda last: self.done.set())


def test_a_change_takes_the_parts_rebuilds_every_server_adopts_and_retires_who_left():
    fakes = Fakes(["ps0", "ps1", "ps2"])
    mover = fakes.mover()
    grown = mover.change(["ps0", "ps1", "ps2"])
    assert grown["epoch"] == 2 and grown["moved_slots"] == 4 and grown["state"] == "done"
    assert grown["ahead_bytes"] == 200 and grown["bytes"] == 200      # the fakes' parts are 100 bytes each
    names = [(c[1], c[-2] if c[1] == "take_part" else None, c[-1]) for c in fakes.calls]
    # Copied ahead and built aside while training goes on, then only the changes and the rebuilds held.
    assert names == [("take_part", "early", False)] * 2 + [("prepare", None, False)] * 3 + \
        [("take_part", "changes", True)] * 2 + [("relayout", None, True)] * 3, names
    takes = [c for c in fakes.calls if c[1] == "take_part"]
    assert sorted((c[0], c[2]) for c in takes) == [("ps2", "ps0")] * 2 + [("ps2", "ps1")] * 2
    rebuilt = [c for c in fakes.calls if c[1] in ("prepare", "relayout")]
    assert sorted(c[0] for c in rebuilt) == ["ps0", "ps0", "ps1", "ps1", "ps2", "ps2"]
    assert all(c[2]["epoch"] == 2 for c in rebuilt)
    assert fakes.slots.epoch == 2 and fakes.slots.servers == ("ps0", "ps1", "ps2")
    # What is taken under the hold is small: a destination frozen then holds the trainers a minute
    # at most, not the ten a copy of everything may take.
    assert {(m, stage): t for m, stage, t in fakes.timeouts} == {
        ("take_part", "early"): 600.0, ("prepare", None): 600.0, ("take_part", "changes"): 60.0,
        ("relayout", None): 600.0}
    fakes.calls.clear()
    mover.change(["ps0", "ps2"])
    assert ("ps1", "retire") in [(c[0], c[1]) for c in fakes.calls]
    assert mover.change(["ps0", "ps2"])["state"] == "unchanged"


def test_a_change_that_cannot_copy_ahead_copies_all_of_it_held():
    fakes = Fakes(["ps0", "ps1", "ps2"])
    fakes.fail_ahead = True
    grown = fakes.mover().change(["ps0", "ps1", "ps2"])
    assert grown["state"] == "done" and "ahead_bytes" not in grown
    assert [(c[1], c[-2], c[-1]) for c in fakes.calls if c[1] == "take_part"] == [("take_part", "all", True)] * 2


def test_a_change_whose_server_left_while_copying_ahead_fails_without_holding_the_trainers():
    fakes = Fakes(["ps0", "ps1", "ps2"])
    fakes.fail_ahead = True
    call = fakes.call

    def lost_ps2(to, method, *args, timeout=None):
        if to == "ps2" and "ps2" in fakes.members:
            fakes.members.remove("ps2")              # declared lost as its copy failed
        return call(to, method, *args, timeout=timeout)
    fakes.call = lost_ps2
    mover = fakes.mover()
    with pytest.raises(PeerUnavailable, match="layout 1 stays in force: ps2 left the members while copying ahead"):
        mover.change(["ps0", "ps1", "ps2"])
    assert [c for c in fakes.calls if c[-1]] == [], "nothing asked under the trainers' hold"
    assert fakes.slots.epoch == 1 and mover.last["state"] == "failed" and fakes.done.is_set()


def test_a_change_refused_changes_nothing():
    fakes = Fakes(["ps0", "ps1"])
    mover = fakes.mover()
    with pytest.raises(BadRequest, match="begin with the leader"):
        mover.change(["ps1", "ps0"])
    with pytest.raises(NotReady, match="ps2 is not serving yet"):
        mover.change(["ps0", "ps1", "ps2"])
    assert fakes.calls == [] and fakes.slots.epoch == 1


def test_a_change_asked_before_its_server_serves_runs_once_it_does():
    fakes = Fakes(["ps0", "ps1"])
    mover = fakes.mover()
    waiting = mover.request(["ps0", "ps1", "ps2"])
    assert waiting == {"state": "waiting", "to": ["ps0", "ps1", "ps2"], "awaiting": ["ps2"], "epoch": 1}
    mover.tick()
    assert fakes.calls == [] and mover.wanted == ["ps0", "ps1", "ps2"]
    fakes.members.append("ps2")
    mover.tick()
    assert fakes.done.wait(10)
    wait_until(lambda: fakes.slots.epoch == 2, 10, "the change adopted")
    assert mover.wanted is None and mover.last["state"] == "done"


def test_moves_are_grouped_by_destination_and_source():
    old = Slots.even(2, 12)
    new = old.rebalanced(["ps0", "ps1", "ps2"])
    grouped = by_destination(old.moves(new))
    assert set(grouped) == {"ps2"} and set(grouped["ps2"]) == {"ps0", "ps1"}
    assert sorted(s for slots, _ in grouped["ps2"].values() for s in slots) == \
        [s for s, k in enumerate(new.owners) if k == 2]


class Failing(Fakes):
    """Servers whose rebuild fails: ``dies`` (it left the members as it failed), ``once`` (a
    call that failed on its way, answered when asked again) or ``stays`` (it fails every time,
    and answers on)."""

    def __init__(self, members, dies=(), once=(), stays=()):
        super().__init__(members)
        self.dies, self.once, self.stays = set(dies), set(once), set(stays)

    def call(self, to, method, *args, timeout=None):
        if method is MoveSurface.relayout and (to in self.dies or to in self.once or to in self.stays):
            self.calls.append((to, "relayout failed"))
            self.once.discard(to)
            if to in self.dies and to in self.members:
                self.members.remove(to)
            raise ConnectionError(f"{to} went away")
        return super().call(to, method, *args, timeout=timeout)


def test_a_server_lost_in_the_rebuilds_leaves_the_new_layout_in_force_and_named():
    fakes = Failing(["ps0", "ps1", "ps2"], dies=["ps1"])
    grown = fakes.mover().change(["ps0", "ps1", "ps2"])
    # ps0 and ps2 rebuilt by layout 2: going back would give ps2's slots two owners
    assert grown["state"] == "done" and grown["not_rebuilt"] == ["ps1"], grown
    assert fakes.slots.epoch == 2
    assert [c for c in fakes.calls if c[0] == "ps1" and c[1].startswith("relayout")] == [("ps1", "relayout failed")]
    assert fakes.evicted == [], "a server that left is not evicted again"


def test_a_server_that_fails_its_rebuild_twice_and_answers_on_is_put_out_of_the_group():
    # It holds layout 1's shard: kept in, the trainers (on layout 2) would be refused by it for
    # good. Out of the group, it starts again and restores by layout 2, as a lost server does.
    fakes = Failing(["ps0", "ps1", "ps2"], stays=["ps2"])
    grown = fakes.mover().change(["ps0", "ps1", "ps2"])
    assert grown["state"] == "done" and grown["not_rebuilt"] == ["ps2"] and fakes.slots.epoch == 2
    assert [c[1] for c in fakes.calls if c[0] == "ps2" and c[1].startswith("relayout")] == ["relayout failed"] * 2
    assert fakes.evicted == [(["ps2"], "did not rebuild its shard by layout 2")]


def test_a_change_adopted_stands_when_the_server_left_unrebuilt_cannot_be_put_out():
    fakes = Failing(["ps0", "ps1", "ps2"], stays=["ps2"])
    mover = Mover(lambda: fakes.slots, fakes.adopt, fakes.paused, lambda names, why: 1 / 0,
                  lambda: fakes.members, fakes.call)
    grown = mover.change(["ps0", "ps1", "ps2"])
    assert grown["state"] == "done" and grown["not_rebuilt"] == ["ps2"] and fakes.slots.epoch == 2


def test_a_rebuild_that_failed_on_its_way_is_asked_again():
    fakes = Failing(["ps0", "ps1", "ps2"], once=["ps2"])
    grown = fakes.mover().change(["ps0", "ps1", "ps2"])
    assert grown["state"] == "done" and "not_rebuilt" not in grown and fakes.slots.epoch == 2 and not fakes.evicted
    assert [c[1] for c in fakes.calls if c[0] == "ps2" and c[1].startswith("relayout")] == ["relayout failed", "relayout"]


def test_a_change_no_server_rebuilt_for_fails_and_leaves_the_old_layout():
    fakes = Failing(["ps0", "ps1", "ps2"], dies=["ps0", "ps1", "ps2"])
    mover = fakes.mover()
    with pytest.raises(PeerUnavailable, match="failed, layout 1 stays in force: ps[0-2] went away") as raised:
        mover.change(["ps0", "ps1", "ps2"])
    assert isinstance(raised.value.__cause__, ConnectionError)
    assert fakes.slots.epoch == 1 and mover.last["state"] == "failed"


def test_a_change_under_way_shows_its_seconds_so_far():
    fakes = Fakes(["ps0", "ps1", "ps2"])
    seen = []
    fakes.adopt = lambda slots: seen.append(mover.progress())        # in the middle of the change
    mover = fakes.mover()
    assert mover.progress() is None
    mover.change(["ps0", "ps1", "ps2"])
    assert seen[0]["state"] == "moving" and seen[0]["elapsed_seconds"] >= 0 and seen[0]["moved_slots"] == 4
    assert mover.progress()["state"] == "done" and "elapsed_seconds" not in mover.progress()
