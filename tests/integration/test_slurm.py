"""rpcps as a Slurm job, as a user runs it: the shipped batch script (``deploy/slurm/rpcps.sbatch``)
submitted with ``sbatch`` to a real Slurm cluster of four nodes, each an emulated host
(``tests/support/slurm.py``). The movies example (a user's model) trains across them with two
servers and two trainers; ``rpcps status`` on the login node lists every member; a node cut off
costs its member a start on another node; ``scancel`` stops them all with a final checkpoint; a
resubmitted job resumes from it and ends by itself."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.cluster import REPO
from tests.support.slurm import SlurmCluster, missing
from tests.support.wait import wait_until

SCRIPT = REPO / "deploy" / "slurm" / "rpcps.sbatch"
MOVIES = ["--workload", "ctr", "--model", "movies_deepfm.model:DeepFM", "--schema", "movies_deepfm/movies.yaml",
          "--data", "ratings", "--optimizer", "adagrad", "--batch-size", "256", "--eval-samples", "2000",
          "--checkpoint-dir", "ckpt", "--member-timeout", "6"]
NODE_CPUS = 0.4        # four nodes: 1.6 of this machine's 2 cores at most


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=4, cpus=NODE_CPUS)
    try:
        yield cluster.start()
    finally:
        cluster.close()


@pytest.fixture
def work(tmp_path) -> Path:
    """The user's folder on shared storage: the example, and data made by `rpcps data`."""
    shutil.copytree(REPO / "examples" / "movies_deepfm", tmp_path / "movies_deepfm")
    subprocess.run([sys.executable, "-m", "supervise.cli", "data", "ratings", "--rows", "20000", "--out", "ratings"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    return tmp_path


def user_env(slurm: SlurmCluster) -> dict[str, str]:
    """What the user's shell exports before sbatch (jobs inherit it): rpcps on PATH, torch's
    threads for a node's share of the CPU, and the nodes' interface."""
    return {**slurm.hosts.environ(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def status(slurm: SlurmCluster, work: Path) -> dict:
    r = slurm.login(["rpcps", "status", "--json"], cwd=work, env=user_env(slurm), check=False)
    return json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}


def members_left(slurm: SlurmCluster) -> list[str]:
    """The rpcps processes still on any node."""
    left = []
    for node in slurm.nodes:
        for pid in (slurm.hosts.quotas[node].cpu / "cgroup.procs").read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "supervise.cli" in cmdline:
                left.append(f"{node}: {cmdline}")
    return left


def checkpoints(slurm: SlurmCluster, work: Path) -> list[dict]:
    r = slurm.login(["rpcps", "checkpoint", "--list", "--json", "--checkpoint-dir", "ckpt"], cwd=work,
                    env=user_env(slurm), check=False)
    return json.loads(r.stdout)["checkpoints"]


def job_output(work: Path, job: int) -> str:
    path = work / f"rpcps-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output yet)"


def test_a_job_trains_across_nodes_stops_on_scancel_and_resumes_when_resubmitted(slurm, work):
    env = user_env(slurm)
    submitted = time.monotonic()
    job = slurm.sbatch(SCRIPT, MOVIES, work, env)

    def training():
        s = status(slurm, work)
        steps = [m.get("step") or 0 for name, m in s.items() if name.startswith("ctr")]
        if slurm.state(job) not in ("PENDING", "CONFIGURING", "RUNNING"):
            raise AssertionError(f"job {job} ended: {job_output(work, job)[-3000:]}")
        return len(steps) == 2 and min(steps) >= 1 and s
    try:
        seen = wait_until(training, 180, "both trainers stepping, as rpcps status on the login node shows")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{job_output(work, job)[-3000:]}\n{slurm.logs()}") from None
    first_step = time.monotonic() - submitted

    # Every member on a node of its own, by the stated rule: the servers first, ps0 (the leader)
    # on the batch node; each sidecar answered at its node's name, port 8080.
    state = json.loads((work / ".rpcps" / "cluster.json").read_text())
    assert {n: h["node"] for n, h in state["hosts"].items()} == \
        {"ps0": "node1", "ps1": "node2", "ctr0": "node3", "ctr1": "node4"}
    assert state["sidecars"] == {n: f"http://node{i + 1}:8080" for i, n in enumerate(["ps0", "ps1", "ctr0", "ctr1"])}
    assert all(m["state"] == "running" for m in seen.values()), seen

    trained = sum(m["step"] for n, m in status(slurm, work).items() if n.startswith("ctr"))
    cancelled = time.monotonic()
    slurm.login(["scancel", str(job)])
    try:
        wait_until(lambda: slurm.state(job) not in ("RUNNING", "COMPLETING") and not members_left(slurm), 60,
                   f"job {job} over and every member gone from the nodes")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: job {slurm.state(job)}, left {members_left(slurm)}\n"
                             f"{job_output(work, job)[-3000:]}\n{slurm.logs()}") from None
    gone = time.monotonic() - cancelled
    assert slurm.state(job) == "CANCELLED"
    final = checkpoints(slurm, work)
    assert final and final[0]["state"] == "complete", final
    assert sorted(final[0]["files"]) == ["ctr0.pt", "ctr1.pt", "ps0.pt", "ps1.pt"]
    # Async: the servers' step counts both trainers' updates, taken on the way out.
    assert final[0]["step"] >= trained, (final, trained)

    # Resubmitted, the same job resumes from that checkpoint and ends with its episode.
    again = slurm.sbatch(SCRIPT, [*MOVIES, "--steps", "5"], work, env)
    assert slurm.wait_done(again, 240) == "COMPLETED", job_output(work, again)[-3000:]
    ps0 = (work / ".rpcps" / "logs" / "ps0.log").read_text(errors="replace")
    assert f"resuming from {final[0]['id']} (step {final[0]['step']})" in ps0
    assert "done: 5 steps" in job_output(work, again)
    assert not members_left(slurm)
    print(f"\nSlurm: sbatch to both trainers stepping {first_step:.1f} s; scancel to every member gone {gone:.1f} s")


def placed(work: Path, name: str) -> str:
    return json.loads((work / ".rpcps" / "cluster.json").read_text())["hosts"][name]["node"]


def trainer_steps(slurm: SlurmCluster, work: Path) -> int:
    return sum(m.get("step") or 0 for n, m in status(slurm, work).items() if n.startswith("ctr"))


@contextlib.contextmanager
def a_job(slurm: SlurmCluster, work: Path, args: list[str]) -> Iterator[int]:
    """A job submitted from ``work``; a failure said with its output and the daemons' logs; at
    the end, cancelled and its members gone."""
    job = slurm.sbatch(SCRIPT, args, work, user_env(slurm))
    try:
        yield job
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{job_output(work, job)[-3000:]}\n{slurm.logs()}") from None
    finally:
        slurm.login(["scancel", str(job)], check=False)
        wait_until(lambda: slurm.state(job) not in ("RUNNING", "COMPLETING") and not members_left(slurm), 60,
                   f"job {job} over")


def resumed(slurm: SlurmCluster, work: Path, job: int, newest: dict) -> None:
    """The requeued ``job`` trains again, its leader restored from checkpoint ``newest``."""
    wait_until(lambda: slurm.state(job) == "RUNNING" and trainer_steps(slurm, work) > 0, 180,
               "the requeued job training again")
    ps0 = (work / ".rpcps" / "logs" / "ps0.log").read_text(errors="replace")
    assert f"resuming from {newest['id']} (step {newest['step']})" in ps0, ps0[-3000:]


@pytest.mark.timeout(600)      # three faults in one job: 203-223 s on a quiet day, 307 s on a slow one
def test_a_node_set_down_moves_its_member_a_requeue_and_the_batch_node_lost_resume_from_the_newest_checkpoint(
        slurm, work):
    # One job for three faults in a row (a job's start is what these tests spend most on).
    with a_job(slurm, work, [*MOVIES, "--checkpoint-every-steps", "50"]) as job:
        wait_until(lambda: len([m for n, m in status(slurm, work).items() if n.startswith("ctr") and m.get("step")])
                   == 2, 180, "both trainers stepping")
        assert placed(work, "ctr1") == "node4"
        # node4's slurmd hangs: the controller sets node4 DOWN, and the job (--no-kill) loses it
        # from its allocation. ctr1 still runs there and answers, until Slurm ends its step: then
        # it starts on another node of the allocation, and the old one, no longer asked, fences itself.
        slurm.hang("node4")
        hung = time.monotonic()
        try:
            moved = wait_until(lambda: (node := placed(work, "ctr1")) != "node4" and node, 90,
                               "ctr1 started on another node")
            downed = slurm.node_state("node4")
            before = trainer_steps(slurm, work)
            wait_until(lambda: status(slurm, work).get("ctr1", {}).get("state") == "running"
                       and trainer_steps(slurm, work) > before + 2, 90, "training on, ctr1 on its new node")
            going_on = time.monotonic() - hung
            wait_until(lambda: not [m for m in members_left(slurm) if m.startswith("node4:")], 30,
                       "the old ctr1 gone from node4")
        finally:
            slurm.hang("node4", False)
        assert downed.startswith("down"), downed
        assert moved in ("node1", "node2", "node3"), moved
        assert slurm.state(job) == "RUNNING"
        assert f"ctr1 cannot start where it ran (its node node4 is no longer in Slurm job {job}'s allocation" \
            in job_output(work, job), job_output(work, job)[-3000:]

        # node4 back (ReturnToService=2), the whole job requeued: every member stops (the servers
        # checkpoint on the way out), and the job, started again, resumes from the newest checkpoint.
        wait_until(lambda: slurm.node_state("node4") in ("idle", "mix", "alloc"), 60, "node4 back in service")
        slurm.login(["scontrol", "requeue", str(job)])
        wait_until(lambda: slurm.state(job) == "PENDING" and not members_left(slurm), 90,
                   "the requeued job's members gone")
        newest = checkpoints(slurm, work)[0]
        assert newest["state"] == "complete", newest
        requeued = time.monotonic()
        resumed(slurm, work, job, newest)
        again = time.monotonic() - requeued

        # The batch node lost: rpcps up and the leader run there, and the job outlives node
        # failures (--no-kill), so Slurm would keep it running with nothing in it. The members,
        # their leader lost and no supervisor asking, requeue it; it starts again when the node is back.
        batch = placed(work, "ps0")
        slurm.crash(batch)
        crashed = time.monotonic()
        try:
            wait_until(lambda: slurm.state(job) in ("COMPLETING", "PENDING"), 60, "the job requeued")
            lost_requeued = time.monotonic() - crashed
            newest = next(c for c in checkpoints(slurm, work) if c["state"] == "complete")
        finally:
            slurm.boot(batch)         # back, as a machine that restarts
        resumed(slurm, work, job, newest)
        lost_again = time.monotonic() - crashed
    print(f"\nSlurm: node4's slurmd hung: ctr1 on {moved}, training on after {going_on:.1f} s; "
          f"requeued: training again {again:.1f} s after it was pending; the batch node ({batch}) lost: the job "
          f"requeued after {lost_requeued:.1f} s, training again after {lost_again:.1f} s")


def test_a_member_on_a_node_cut_off_starts_again_on_another_node(slurm, work):
    # A job of its own, left to the cluster's end: a step on a node that was cut off keeps its
    # job COMPLETING until that node's slurmd gets the step's end through, on a back-off of its own.
    job = slurm.sbatch(SCRIPT, MOVIES, work, user_env(slurm))
    wait_until(lambda: len([m for n, m in status(slurm, work).items() if n.startswith("ctr") and m.get("step")]) == 2,
               180, "both trainers stepping")
    assert placed(work, "ctr1") == "node4"
    # node4 cut off from the others (its link down, ctr1 running on there): ctr1 is declared lost
    # within the deadline, fences itself, and starts again on another node of the allocation,
    # where training goes on while node4 is still cut off.
    wait_until(lambda: "ctr1" in json.loads((work / ".rpcps" / "cluster.json").read_text())["answering"], 30,
               "rpcps up to hear ctr1")
    slurm.hosts.net.connect("node4", False)
    cut = time.monotonic()
    try:
        moved = wait_until(lambda: (node := placed(work, "ctr1")) != "node4" and node, 60, "ctr1 started on another node")
        detected = time.monotonic() - cut
        before = trainer_steps(slurm, work)
        wait_until(lambda: status(slurm, work).get("ctr1", {}).get("state") == "running"
                   and trainer_steps(slurm, work) > before + 2, 90,
                   "training on, ctr1 on its new node")
        going_on = time.monotonic() - cut
    finally:
        slurm.hosts.net.connect("node4", True)
    assert moved in ("node1", "node2", "node3") and detected < 6 + 15, (moved, detected)
    assert "ctr1 lost:" in job_output(work, job), job_output(work, job)[-3000:]
    assert not [m for m in members_left(slurm) if m.startswith("node4:")], "the old ctr1 still runs on node4"

    print(f"\nSlurm: node4 cut off: ctr1 on {moved} after {detected:.1f} s, training on after {going_on:.1f} s")
