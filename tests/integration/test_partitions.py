"""A member cut off from the network, on emulated hosts (``rpcps up --emulate-hosts``), its process
running on: ``rpcps chaos --fault partition`` downs its host's link. For less than
``--member-timeout`` nothing is replaced and the job goes on once the link is back; for longer, the
member fences itself, a replacement starts on a fresh host and the job goes on while the link is
still down, and when it returns the old member is gone. The leader too. Skips, saying why, where
hosts cannot be emulated."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.checkpoint.store import CheckpointStore
from supervise.hosts.emulated import remove_all
from supervise.hosts.quota import CGROUP
from tests.integration.test_emulated_hosts import _hosts_possible, _namespaces
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

TIMEOUT = 6.0       # --member-timeout: short, so that the test is; the default is 15 s


def chaos(up: UpProcess, member: str, seconds: float) -> dict:
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "chaos", "--json", "--state-dir", str(up.state_dir),
                           "--fault", "partition", "--for", str(seconds), "--members", member, "--kills", "1",
                           "--interval", "0.1", "--recover-timeout", "120"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{up.explain()}\n{up.logs()}"
    record = next(json.loads(line) for line in done.stdout.splitlines() if json.loads(line)["event"] == "kill")
    print(f"{member} cut off {seconds:g}s: {record}")
    return record


def processes_on(namespace: str) -> list[str]:
    group = CGROUP / "cpu" / namespace / "cgroup.procs"
    return group.read_text().split() if group.exists() else []


def test_a_member_cut_off_is_waited_for_or_fenced_and_replaced_on_a_fresh_host(tmp_path):
    _hosts_possible()
    up = UpProcess(tmp_path, "--workload", "ctr", "--emulate-hosts", "--host-cpus", "0.4", "--num-ps", "2",
                   "--num-trainers", "2", "--steps", "100000", "--scale", "0.01", "--batch-size", "256",
                   "--eval-samples", "512", "--checkpoint-every-steps", "50", "--member-timeout", str(TIMEOUT),
                   "--restart-backoff", "0.5", "--no-final-checkpoint", "--progress-interval", "60")
    tag = str(up.proc.pid % 100000)
    try:
        up.wait_event("started", 240)
        folder = CheckpointStore(Path(up.cluster()["checkpoint_dir"]))
        wait_until(lambda: folder.list(), 120, "a first checkpoint")
        # Shorter than the timeout: no one is replaced or fenced, and the job goes on.
        brief = chaos(up, "ps1", 2.0)
        assert not brief["replaced"] and brief["next_step_seconds"] is not None and not brief["stepped_during"], brief
        # Past a timeout after it, nothing was replaced: and the next cut's silence starts afresh.
        back = time.monotonic()
        wait_until(lambda: time.monotonic() - back > TIMEOUT + 1, TIMEOUT + 2, "a timeout after the brief cut")
        assert not [e for e in up.drain() if e["event"] in ("lost", "restart")], up.events

        # Longer: fenced (it stops by itself: its lease ran out), replaced on a fresh host, and
        # the job steps again while its old host is still cut off; back, the old one is gone.
        old = up.cluster()["placed"]["ps1"]
        # The cut lasts well past what a replacement takes on 0.4-core hosts (13-19 s seen), so that
        # the job is seen to step while the old host is still cut off.
        cut = chaos(up, "ps1", TIMEOUT + 20)
        # Its lease counts from the last ask it heard, up to a probe (1 s) before the cut.
        assert cut["replaced"] and TIMEOUT - 1 <= cut["detected_seconds"] < TIMEOUT + 4, cut
        assert cut["stepped_during"] and cut["next_step_seconds"] < TIMEOUT + 20, cut
        assert not cut["old_running"] and processes_on(old["namespace"]) == [], "the old ps1 still runs"
        placed = up.cluster()["placed"]["ps1"]
        assert placed["host"] == "ps1-2" and placed["namespace"] != old["namespace"], placed
        # Whichever came first, its lease or rpcps up's deadline: one loss, one replacement.
        assert [e["name"] for e in up.drain() if e["event"] == "lost"] == ["ps1"], up.events

        # The leader: fenced and replaced on a fresh host; every member leaves its group and
        # joins the new leader's; the job goes on while the old leader's host is still cut off. Every
        # member starts again on 0.4-core hosts: 17-25 s seen from its detection to the next step,
        # 25-31 s from the cut.
        leader = chaos(up, "ps0", TIMEOUT + 34)
        assert leader["replaced"] and leader["stepped_during"], leader
        assert leader["next_step_seconds"] < TIMEOUT + 34, leader
        assert up.cluster()["placed"]["ps0"]["host"] == "ps0-2"
    finally:
        up.kill()
        remove_all(tag)
    assert _namespaces(tag) == []
