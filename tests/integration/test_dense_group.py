"""--dense allreduce: a trainer whose collective failed leaves its process group at once, so a
peer that waits on it in a collective fails now, not at the group's timeout. In a ring of three,
the dead trainer's neighbour sees the death first; the third member waits on that neighbour, and
waited out the timeout (30 s by default) whenever the neighbour kept its connections open."""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.support.group_member import GROUP_TIMEOUT


@pytest.fixture
def members():
    """Starts group members; kills each at the end, even when the test fails."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "tests.support.group_member", *args],
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
