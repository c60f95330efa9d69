"""``rpcps bench recovery``: under ``--dense allreduce``, how long training stops when a trainer
dies, two ways against the same two sync servers:

(a) ``rpcps``: three trainers; one is killed with SIGKILL. Measured: seconds from the kill to the
    survivors' next step (their new process group formed, their replicas taken on), and to the
    first step of a replacement started at the kill (as ``rpcps up`` restarts it).
(b) ``torchrun``: the same three trainers as torchrun's workers (``--max-restarts``); one is
    killed. torchrun stops every worker and starts them all again; measured: seconds from the kill
    to the first step after the restart.
(c) ``server``: two trainers; the server ps1 is killed with SIGKILL and started again at once (as
    ``rpcps up`` restarts it). The trainers lose a step and wait for it in the same processes;
    measured: seconds from the kill, and from ps1 serving again (its sidecar ready), to their
    next step.

A step is seen in the trainers' /status (the step clock's step their replicas are at), polled
every 20 ms. Prints JSON lines, the last one the summary: the median of each figure, and its worst.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from trainer.lm.bench import poll_until, sidecar_ready

TARGETS = {"survivors_next_step_s": 5.0, "return_to_step_s": 5.0}
TRAINERS = ["trainer0", "trainer1", "trainer2"]
VICTIM = 1
POLL = 0.02   # seconds between reads of the trainers' steps while a recovery is timed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON lines only (the output is JSON either way)")
    p.add_argument("--kills", type=int, default=3, help="trainers (or ps1) killed, one after another, in each way")
    p.add_argument("--ways", default="rpcps,torchrun,server", help="comma-separated subset of rpcps, torchrun, server")


def _status(url: str) -> dict:
    from services.client import SidecarClient
    with SidecarClient(url, timeout=2.0) as c:
        return c.status()


def _replica(url: str) -> Optional[dict]:
    try:
        return _status(url).get("dense_replica")
    except Exception:  # noqa: BLE001 - down or restarting: no step seen there
        return None


def _worker_pid(agent: int, rank: int) -> int:
    """The pid of torchrun's worker ``rank``: a child of its agent with that RANK."""
    for task in os.listdir(f"/proc/{agent}/task"):
        with open(f"/proc/{agent}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/environ", "rb") as env:
                    if f"RANK={rank}".encode() in env.read().split(b"\0"):
                        return int(child)
    raise SystemExit(f"rpcps bench recovery: torchrun has no worker of rank {rank}")


def _stepping(urls: list[str], group_size: int, after: int = -1, not_in: str = "") -> Callable[[], Optional[int]]:
    """A probe: the furthest step, past ``after``, that a trainer at ``urls`` took in a group of
    ``group_size`` or more, other than the group ``not_in``."""
    def probe() -> Optional[int]:
        steps = [r["step"] for r in map(_replica, urls)
                 if r and len(r["allreduce_group"]) >= group_size and r["group_id"] != not_in]
        best = max(steps, default=-1)
        return best if best > after else None
    return probe


def _furthest(urls: list[str]) -> int:
    return max((r["step"] for r in map(_replica, urls) if r), default=-1)


def run(ns: argparse.Namespace) -> int:
    from supervise.processes import free_port, spawn_role, stop_in_waves

    ways = [w for w in ns.ways.split(",") if w]
    with tempfile.TemporaryDirectory(prefix="rpcps-recovery-") as tmp:
        root, port = Path(tmp), free_port()
        common = ["--master-port", str(port), "--checkpoint-dir", str(root / "ckpt"), "--num-ps", "2"]
        trainer_flags = ["--num-ps", "2", "--dense", "allreduce", "--synthetic-tokens", "50000", "--log-interval", "5"]
        servers: dict[str, tuple[subprocess.Popen, str]] = {}

        def start_server(name: str) -> str:
            sidecar = free_port()
            servers[name] = (spawn_role("supervise.cli", ["ps", "--name", name, "--sidecar-port", str(sidecar),
                                                         *common, "--consistency", "sync", "--no-resume"],
                                        root / f"{name}.log"), f"http://127.0.0.1:{sidecar}")
            return servers[name][1]
        for name in ("ps0", "ps1"):
            start_server(name)
        results = {}
        try:
            for _, url in servers.values():
                poll_until(lambda: sidecar_ready(url), 120, "the servers")
            if "rpcps" in ways:
                results["rpcps"] = _rpcps_way(ns.kills, root, port, trainer_flags)
            if "torchrun" in ways:
                results["torchrun"] = _torchrun_way(ns.kills, root, port, trainer_flags)
            if "server" in ways:
                results["server"] = _server_way(ns.kills, root, port, trainer_flags,
                                                lambda: servers["ps1"][0], lambda: start_server("ps1"))
        finally:
            stop_in_waves([[("ps1", servers["ps1"][0])], [("ps0", servers["ps0"][0])]], 15.0)
    summary: dict = {"bench": "recovery", "kills": ns.kills, "targets": TARGETS, "results": {}, "worst": {}}
    for way, runs in results.items():
        summary["results"][way] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        summary["worst"][way] = {k: max(r[k] for r in runs) for k in runs[0]}
    met = {}
    if "rpcps" in summary["results"]:
        met["survivors_next_step_s"] = summary["results"]["rpcps"]["survivors_next_step_s"] \
            <= TARGETS["survivors_next_step_s"]
    if "server" in summary["results"]:
        met["return_to_step_s"] = summary["worst"]["server"]["return_to_step_s"] <= TARGETS["return_to_step_s"]
    if met:
        summary["met"] = met
    print(json.dumps(summary), flush=True)
    return 0


def _rpcps_way(kills: int, root: Path, port: int, flags: list[str]) -> list[dict]:
    from supervise.processes import stop_in_waves

    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    start = _trainers(procs, urls, root, port, flags, len(TRAINERS))
    runs = []
    try:
        for name in TRAINERS:
            start(name)
        everyone = lambda: [urls[n] for n in TRAINERS]  # noqa: E731 - the victim's url changes with each restart
        poll_until(_stepping(everyone(), 3), 300, "three trainers stepping")
        victim = TRAINERS[VICTIM]
        survivors = [urls[n] for n in TRAINERS if n != victim]
        for _ in range(kills):
            at = _furthest(everyone())
            # The survivors' next step is one in a group without the dead trainer: a step of the
            # old group may still complete, and the replacement may be in the new one already.
            old = _replica(survivors[0])["group_id"]
            procs[victim].kill()
            killed = time.monotonic()
            procs[victim].wait(30)
            start(victim)    # at once: what rpcps up does after --restart-backoff
            next_step = poll_until(_stepping(survivors, 2, at, old), 120, "the survivors' next step", POLL)
            resumed = time.monotonic() - killed
            poll_until(_stepping(everyone(), 3, next_step), 300, "the replacement's first step", POLL)
            runs.append({"survivors_next_step_s": round(resumed, 3),
                         "replacement_in_step_s": round(time.monotonic() - killed, 3)})
            print(json.dumps({"bench": "recovery", "way": "rpcps", **runs[-1]}), flush=True)
    finally:
        stop_in_waves([list(procs.items())], 30.0)
    return runs


def _trainers(procs: dict[str, subprocess.Popen], urls: dict[str, str], root: Path, port: int, flags: list[str],
              count: int) -> Callable[[str], None]:
    """What starts trainer ``name`` of ``count``, recording its process and sidecar."""
    from supervise.processes import free_port, spawn_role

    def start(name: str) -> None:
        sidecar = free_port()
        urls[name] = f"http://127.0.0.1:{sidecar}"
        procs[name] = spawn_role("supervise.cli", ["trainer", "--name", name, "--sidecar-port", str(sidecar),
                                                  "--master-port", str(port), "--checkpoint-dir", str(root / "ckpt"),
                                                  "--num-trainers", str(count), "--start", *flags],
                                 root / f"{name}.log")
    return start


def _server_way(kills: int, root: Path, port: int, flags: list[str], ps1: Callable[[], subprocess.Popen],
                restart_ps1: Callable[[], str]) -> list[dict]:
    from supervise.processes import stop_in_waves

    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    start = _trainers(procs, urls, root, port, flags, 2)
    runs = []
    try:
        for name in TRAINERS[:2]:
            start(name)
        trainers = [urls[n] for n in TRAINERS[:2]]
        poll_until(_stepping(trainers, 2), 300, "two trainers stepping")
        for _ in range(kills):
            at = _furthest(trainers)
            ps1().kill()
            killed = time.monotonic()
            ps1().wait(30)
            url = restart_ps1()
            poll_until(lambda: sidecar_ready(url), 120, "ps1 serving again", POLL)
            ready = time.monotonic()
            poll_until(_stepping(trainers, 2, at), 120, "the trainers' next step", POLL)
            stepped = time.monotonic()
            if any(p.poll() is not None for p in procs.values()):
                raise SystemExit("rpcps bench recovery: a trainer died when ps1 was killed (see its log in the "
                                 "bench's folder)")
            runs.append({"next_step_s": round(stepped - killed, 3), "return_to_step_s": round(stepped - ready, 3)})
            print(json.dumps({"bench": "recovery", "way": "server", **runs[-1]}), flush=True)
    finally:
        stop_in_waves([list(procs.items())], 30.0)
    return runs


def _torchrun_way(kills: int, root: Path, port: int, flags: list[str]) -> list[dict]:
    from supervise.processes import free_port, stop_in_waves
    from services.torchrun import command

    sidecar = free_port(len(TRAINERS))     # worker k's sidecar listens at sidecar + k
    argv = [*command(), "--standalone", "--nproc-per-node", str(len(TRAINERS)),
            "--max-restarts", str(kills), "-m", "trainer", "--ps-addr", f"127.0.0.1:{port}",
            "--sidecar-port", str(sidecar), "--checkpoint-dir", str(root / "ckpt"), *flags]
    with open(root / "torchrun.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    urls = [f"http://127.0.0.1:{sidecar + rank}" for rank in range(len(TRAINERS))]
    runs = []
    try:
        poll_until(_stepping(urls, 3), 300, "torchrun's three workers stepping")
        for _ in range(kills):
            at = _furthest(urls)
            old = _replica(urls[0])["group_id"]   # a step of the old group may still complete
            os.kill(_worker_pid(proc.pid, VICTIM), signal.SIGKILL)
            killed = time.monotonic()
            poll_until(_stepping(urls, 3, at, old), 300, "the first step after torchrun's restart", POLL)
            runs.append({"next_step_s": round(time.monotonic() - killed, 3)})
            print(json.dumps({"bench": "recovery", "way": "torchrun", **runs[-1]}), flush=True)
    finally:
        stop_in_waves([[("torchrun", proc)]], 30.0)
    return runs
