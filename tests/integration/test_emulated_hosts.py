"""``rpcps up --emulate-hosts``: every member on a host of its own (its network namespace and
address, its PID namespace, its CPU quota), training across them; everything removed after.
Skips, saying why, where hosts cannot be emulated (not root, no iproute2)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from supervise.hosts.emulated import remove_all
from supervise.hosts.network import Unavailable
from supervise.hosts.quota import CGROUP
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow


def _hosts_possible() -> None:
    from supervise.hosts.emulated import EmulatedHosts
    try:
        EmulatedHosts(["probe"], 0.1).create().close()
    except Unavailable as exc:
        pytest.skip(str(exc))


def _namespaces(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    return [n for n in out if n.startswith(f"rpcps{tag}")]


def _thread_names(pid: int) -> list[str]:
    names = []
    for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:       # a thread that ended meanwhile
            pass
    return names


def test_two_trainer_hosts_train_across_their_links_within_their_quotas(tmp_path):
    _hosts_possible()
    up = UpProcess(tmp_path, "--workload", "ctr", "--emulate-hosts", "--host-cpus", "0.3", "--num-ps", "1",
                   "--num-trainers", "2", "--steps", "100", "--scale", "0.01", "--batch-size", "256",
                   "--eval-samples", "512", "--no-final-checkpoint", "--progress-interval", "60")
    tag = str(up.proc.pid % 100000)
    try:
        started = up.wait_event("started", 240)
        state = up.cluster()
        hosts = state["hosts"]
        assert sorted(hosts) == ["ctr0", "ctr1", "ps0"]
        addresses = {h["address"] for h in hosts.values()}
        assert len(addresses) == 3 and all(h["threads"] == 1 and h["cpus"] == 0.3 for h in hosts.values())
        # Each sidecar answers at its host's own address, from this machine over the hosts' bridge.
        assert {httpx.URL(u).host for u in started["sidecars"].values()} == addresses
        for name, host in hosts.items():
            quota = CGROUP / "cpu" / host["namespace"]
            assert int((quota / "cpu.cfs_quota_us").read_text()) == 30000, name
            # The member runs inside its host's quota, as PID 1 of a PID namespace of its own.
            members = [int(p) for p in (quota / "cgroup.procs").read_text().split()]
            nspids = [Path(f"/proc/{p}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
                      for p in members]
            assert any(ids[-1] == "1" for ids in nspids), (name, nspids)
            # One TensorPipe loop thread (--rpc-channel basic): the multiplexed channel would add 16.
            loops = [c for p in members for c in _thread_names(p) if c == "TP_UV_loop"]
            assert len(loops) == 1, (name, loops)
            # Its TCP retries at least every 3 s once a cut link is back (where the kernel can say
            # so), and gives up on a connection no sooner than the machine's own setting does.
            tcp = subprocess.run(["nsenter", f"--net=/run/netns/{host['namespace']}", "sh", "-c",
                                  "cat /proc/sys/net/ipv4/tcp_retries2 /proc/sys/net/ipv4/tcp_rto_max_ms"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            assert tcp[:1] == ["255"] and tcp[1:] in ([], ["3000"]), (name, tcp)

        def link_bytes(name: str) -> int:
            out = subprocess.run(["ip", "-n", hosts[name]["namespace"], "-s", "-j", "link", "show", "eth0"],
                                 capture_output=True, text=True, check=True, timeout=30)
            stats = json.loads(out.stdout)[0]["stats64"]
            return stats["rx"]["bytes"] + stats["tx"]["bytes"]

        def step(name: str) -> int:
            status = httpx.get(f"{started['sidecars'][name]}/status", timeout=5).json()
            # Past its last step the window to measure in is gone: say so rather than time out.
            assert not status.get("episodes_completed"), f"{name} ended its steps before the test measured: {status}"
            return status.get("step", 0)

        # The rows and their gradients cross the trainer's link (no shared memory between hosts).
        first = wait_until(lambda: (s if (s := step("ctr0")) >= 2 else None), 120, "ctr0 past step 2")
        before = link_bytes("ctr0")
        last = wait_until(lambda: (s if (s := step("ctr0")) >= first + 4 else None), 120, "4 more steps of ctr0")
        per_step = (link_bytes("ctr0") - before) / (last - first)
        assert per_step > 100e3, per_step

        done = up.wait_event("done", 300)
        assert done["steps"] == 100 and done["samples_per_s"] > 0 and 0 < done["auc"] < 1, done
        assert up.proc.wait(60) == 0, up.logs()
    finally:
        up.kill()
        remove_all(tag)
    # The launcher removed its hosts on its way out.
    assert _namespaces(tag) == []
    assert not list((CGROUP / "cpu").glob(f"rpcps{tag}-*")), "a CPU quota group was left behind"


def test_the_ring_bench_times_an_all_reduce_across_hosts_with_and_without_their_quota(tmp_path):
    _hosts_possible()
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split())
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "bench", "ring", "--hosts", "2", "--count", "3",
                           "--floats", "20000", "--cpus", "0.5", "--work-ms", "20"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    summary = lines[-1]
    assert [s["setting"] for s in lines[:-1]] == ["unlimited", "quota", "quota_with_work"], lines
    assert summary["bytes"] == 80000 and summary["met"] == {}, summary
    for name, setting in summary["settings"].items():
        # Each setting's all-reduces of each algorithm ran between the two hosts' processes: time on
        # the clock, CPU, 2 exchanges (a pair: the ring's two hops, halving and doubling's two rounds).
        for algorithm in ("ring", "halving_doubling"):
            figures = setting[algorithm]
            assert figures["wall_ms"] > 0 and figures["cpu_ms"] > 0 and figures["hops"] == 2, (name, algorithm, figures)
        assert summary["ratios"][f"{name}_halving_doubling_vs_ring"] > 0, summary["ratios"]
    assert summary["settings"]["quota"]["cpus"] == 0.5 and summary["settings"]["quota_with_work"]["work_ms"] == 20
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split())
    assert after <= before, f"namespaces left behind: {after - before}"


def test_a_server_removed_gives_back_its_host_and_one_added_again_gets_a_fresh_one(tmp_path):
    """What ``rpcps up`` does with its placement when ``rpcps scale`` adds a server, lets it go,
    and adds it again: real hosts, a process started on each."""
    _hosts_possible()
    from supervise.placement.hosts import OnHosts
    place = OnHosts(0.2, "100mbit")
    place.create(["ps0", "ps1"])
    tag = place.hosts.net.tag
    try:
        def serve_once(name: str) -> None:
            """A process on ``name``'s host answers at its address, from this machine."""
            member = place.hosts.spawn(name, [sys.executable, "-m", "http.server", "--bind", place.reach(name), "8000"],
                                       tmp_path / f"{name}.log")
            try:
                wait_until(lambda: _answers(f"http://{place.reach(name)}:8000/"), 60, f"a server on {name}'s host")
            finally:
                member.send_signal(9)
                member.wait(30)

        place.add("ps2")
        first = place.reach("ps2")
        serve_once("ps2")
        place.remove("ps2")
        assert f"rpcps{tag}-ps2" not in _namespaces(tag) and f"rpcps{tag}-ps1" in _namespaces(tag), _namespaces(tag)
        assert not (CGROUP / "cpu" / f"rpcps{tag}-ps2").exists(), "the removed host's CPU group was left"
        place.add("ps2")
        assert place.reach("ps2") != first, "a host added again has an address of its own"
        serve_once("ps2")
        assert place.describe()["ps2"]["link_rate"] == "100mbit"
    finally:
        place.close()
    assert _namespaces(tag) == []
    assert not list((CGROUP / "cpu").glob(f"rpcps{tag}-*")), "a CPU quota group was left behind"


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
