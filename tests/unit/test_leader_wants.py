"""What `rpcps up` does with a parameter server that stopped, by the leader's word (its
``/status``): one of its layout's is started again; one that stopped with exit 0 and holds nothing
is let go; one killed as it left (the leader's last change, done, moved the job off it) is let go
too, not started again to hold nothing for good; a new one lost before it held anything (its
change failed) is started again."""
from pathlib import Path

import pytest

from supervise import roster as roster_module
from supervise.member import Member
from supervise.roster import LeaderWants
from services.workload import Planned


class Leader:
    """The leader's ``/status`` as its sidecar would answer it."""

    answer: dict = {}

    def __init__(self, url, timeout=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def status(self):
        return Leader.answer


class FakeRoster:
    def __init__(self, names):
        self.members = [Member(n, "ps" if n.startswith("ps") else "ctr", [], f"http://{n}", Path("/dev/null"))
                        for n in names]
        self.removed = []

    def remove(self, m):
        self.members.remove(m)
        self.removed.append(m.name)

    def replan(self, planned):
        pass

    def add(self, planned):
        raise AssertionError(f"nothing to start here: {planned.name}")


class Launch:
    def members(self, leader):
        names = leader.get("wanted") or list(leader["layout"]["servers"])
        return [Planned(n, "ps", []) for n in names]


@pytest.fixture
def wants(monkeypatch):
    monkeypatch.setattr(roster_module, "SidecarClient", Leader)
    roster = FakeRoster(["ps0", "ps1", "ps2", "ctr0"])
    return LeaderWants(Launch(), "ps0", roster, liveness=None, emit=lambda e: None), roster


def leader_says(servers, change):
    Leader.answer = {"layout": {"servers": {n: {} for n in servers}}, "change": change}


def member(roster, name):
    return next(m for m in roster.members if m.name == name)


def test_a_server_of_the_layout_is_started_again_whatever_it_died_of(wants):
    want, roster = wants
    leader_says(["ps0", "ps1", "ps2"], {"state": "done", "from": ["ps0", "ps1"], "to": ["ps0", "ps1", "ps2"]})
    assert not want.unwanted(member(roster, "ps1"), -9) and not want.unwanted(member(roster, "ps1"), 0)
    assert roster.removed == []


def test_a_drained_server_is_let_go_on_exit_0_and_when_killed_as_it_leaves(wants):
    want, roster = wants
    leader_says(["ps0", "ps1"], {"state": "done", "from": ["ps0", "ps1", "ps2"], "to": ["ps0", "ps1"]})
    assert want.unwanted(member(roster, "ps2"), -9)
    assert roster.removed == ["ps2"]


def test_a_new_server_lost_in_a_change_that_failed_is_started_again(wants):
    want, roster = wants
    leader_says(["ps0", "ps1"], {"state": "failed", "from": ["ps0", "ps1"], "to": ["ps0", "ps1", "ps2"]})
    assert not want.unwanted(member(roster, "ps2"), -9)
    assert want.unwanted(member(roster, "ps2"), 0)           # told to stop: it holds nothing
    assert roster.removed == ["ps2"]


def test_a_trainer_is_never_the_leaders_to_let_go(wants):
    want, roster = wants
    leader_says(["ps0"], {"state": "done", "from": ["ps0", "ctr0"], "to": ["ps0"]})
    assert not want.unwanted(member(roster, "ctr0"), 0)
