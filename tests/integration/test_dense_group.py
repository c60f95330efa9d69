"""--dense allreduce: a trainer whose collective failed leaves its process group at once, so a
peer that waits on it in a collective fails now, not at the group's timeout. In a ring of three,
the dead trainer's neighbour sees the death first; the third member waits on that neighbour, and
waited out the timeout (30 s by default) whenever the neighbour kept its connections open.

The replicas' sum by halving and doubling (``trainer/core/allreduce.py``) in real gloo groups:
the same bits on every member, and no wait to the timeout when a member leaves."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.support.group_member import GROUP_TIMEOUT
from tests.support.sum_member import GROUP_TIMEOUT as SUM_TIMEOUT
from trainer.core.allreduce import halving, rounds


@pytest.fixture
def members():
    """Starts group members; kills each at the end, even when the test fails."""
    started: list[subprocess.Popen] = []

    def start(*args: str, module: str = "group_member") -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", f"tests.support.{module}", *args],
                             stdout=subprocess.PIPE, text=True)
        started.append(p)
        return p
    yield start
    for p in started:
        p.kill()
        p.wait()


def test_a_member_that_leaves_after_a_failure_ends_its_peers_wait_at_once(members):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=GROUP_TIMEOUT))
    leaver = members("leaver", "0", str(store.port))
    waiter = members("waiter", "1", str(store.port))

    seen = json.loads(waiter.stdout.readline())          # bounded by the group's timeout
    assert seen["total"] is None, seen                   # the all-reduce failed, it did not hang or sum
    assert seen["waited"] < GROUP_TIMEOUT / 6, seen      # it failed when the leaver left, not at the timeout
    assert json.loads(leaver.stdout.readline()) == {"in_group": False}
    store.set("done", "1")
    assert leaver.wait(timeout=30) == 0 and waiter.wait(timeout=30) == 0


def _group(members, roles: list[str], floats: int) -> list[dict]:
    """``roles[rank]`` for each member of one group; every member's printed line."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=SUM_TIMEOUT))
    started = [members(role, str(rank), str(len(roles)), str(store.port), str(floats), module="sum_member")
               for rank, role in enumerate(roles)]
    store.set("ready", "1")
    # Each line bounded by the group's timeout; a member killed prints none (None).
    seen = [json.loads(p.stdout.readline() or "null") for p in started]
    store.set("done", "1")
    assert all(p.wait(timeout=30) in (0, -signal.SIGKILL) for p in started)
    return seen


def test_the_trainers_sum_by_halving_and_doubling_where_it_saves_four_exchanges():
    assert [(n, rounds(n)) for n in (1, 2, 3, 4, 5, 6, 8, 9, 64)] == \
        [(1, 0), (2, 2), (3, 4), (4, 6), (5, 8), (6, 6), (8, 6), (9, 8), (64, 12)]
    assert not halving(5) and halving(6) and halving(4, saved_at_least=1)


@pytest.mark.parametrize("world", [4, 5])
def test_halving_and_doubling_sums_to_the_same_bits_on_every_member(members, world):
    # 5: one member folded into a partner first; an odd length: halves of unequal sizes.
    seen = _group(members, ["summer"] * world, 10_001)
    assert len({s["digest"] for s in seen}) == 1, seen
    assert max(s["error_max"] for s in seen) < 1e-5, seen


@pytest.mark.parametrize("gone", ["leaver", "dies"])
def test_a_member_gone_fails_every_sum_at_once_not_at_the_timeout(members, gone):
    # Of 4, member 0 waits on member 1 alone, whose partner (3) is the one gone: 0 is told by 1.
    seen = _group(members, ["summer", "summer", "summer", gone], 10_001)
    assert seen[3] == ({"left": True} if gone == "leaver" else None)
    for s in seen[:3]:
        assert "error" in s, seen
        assert s["waited"] < SUM_TIMEOUT / 6, seen
