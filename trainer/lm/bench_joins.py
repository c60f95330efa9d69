"""``rpcps bench joins``: what trainers' joins and leaves leave behind on the servers.

Two servers run with a checkpoint every second, so checkpoints meet trainers leaving. Trainers
join one after another (``--parallel`` at a time), train a few steps, and leave: gracefully
(SIGTERM), or every ``--kill-every``-th by SIGKILL, which the leader notices and evicts. After
``--warmup`` joins (first-time allocations, connection pools) each server's resident memory, open
file descriptors and threads are read from /proc; again after ``--joins`` more. Reported: the
growth per join, and the checkpoints that failed (each one that met a leaving trainer must
complete without it). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from trainer.lm.bench import poll_until, sidecar_ready

TARGETS = {"mb_per_join": 0.1, "fds_per_join": 0.0}
MODEL = ["--emsize", "16", "--nhid", "16", "--lr", "0.5"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON only (the output is JSON either way)")
    p.add_argument("--joins", type=int, default=100, help="joins measured, after the warm-up")
    p.add_argument("--warmup", type=int, default=10, help="joins before the first measurement")
    p.add_argument("--kill-every", type=int, default=2, help="every N-th trainer leaves by SIGKILL (0: none)")
    p.add_argument("--parallel", type=int, default=2, help="trainers at a time")
    p.add_argument("--steps", type=int, default=3, help="steps each trainer takes before it leaves")


def _proc(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_mb": rss / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task"))}


TOKENS = 20_000          # each trainer's synthetic corpus


def run(ns: argparse.Namespace) -> int:
    from services.client import SidecarClient
    from supervise.processes import free_port, stop_in_waves

    with tempfile.TemporaryDirectory(prefix="rpcps-joins-") as tmp:
        root, port = Path(tmp), free_port()
        common = ["--master-port", str(port), "--checkpoint-dir", str(root / "ckpt"), "--num-ps", "2"]
        servers = _servers(root, common)
        try:
            for _, url in servers.values():
                poll_until(lambda: sidecar_ready(url), 120, "the servers")
            started = time.monotonic()
            _joins(ns, root, common, servers["ps0"][1], 0, ns.warmup)
            before = {n: _proc(p.pid) for n, (p, _) in servers.items()}
            _joins(ns, root, common, servers["ps0"][1], ns.warmup, ns.joins)
            after = {n: _proc(p.pid) for n, (p, _) in servers.items()}
            with SidecarClient(servers["ps0"][1], timeout=5.0) as c:
                metrics = c.metrics()
            failures = sum(float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("rpcps_checkpoint_failures_total"))
            checkpoints = len(list((root / "ckpt").glob("step-*")))
        finally:
            stop_in_waves([[("ps1", servers["ps1"][0])], [("ps0", servers["ps0"][0])]], 15.0)
    per_join = {n: {k: (after[n][k] - before[n][k]) / ns.joins for k in before[n]} for n in before}
    result = {"bench": "joins", "joins": ns.joins, "warmup": ns.warmup, "killed_every": ns.kill_every,
              "seconds": round(time.monotonic() - started, 1), "before": before, "after": after,
              "per_join": per_join, "checkpoint_failures": failures, "checkpoints_kept": checkpoints,
              "worst_mb_per_join": max(v["rss_mb"] for v in per_join.values()),
              "worst_fds_per_join": max(v["fds"] for v in per_join.values()),
              "median_threads_per_join": statistics.median(v["threads"] for v in per_join.values()),
              "targets": TARGETS}
    print(json.dumps(result), flush=True)
    return 0


def _servers(root: Path, common: list[str]) -> dict[str, tuple]:
    """ps0 and ps1 started: each one's process and sidecar URL."""
    from supervise.processes import free_port, spawn_role
    from trainer.lm.data import vocab_size
    servers: dict[str, tuple] = {}
    for name in ("ps0", "ps1"):
        url_port = free_port()
        proc = spawn_role("supervise.cli", ["ps", "--name", name, "--sidecar-port", str(url_port), *common,
                                           "--ntoken", str(vocab_size(None)), "--no-resume", *MODEL,
                                           "--checkpoint-every-seconds", "1"], root / f"{name}.log")
        servers[name] = (proc, f"http://127.0.0.1:{url_port}")
    return servers


def _joins(ns: argparse.Namespace, root: Path, common: list[str], leader: str, first: int, count: int) -> None:
    """Trainers ``first`` .. ``first + count - 1`` join, train their episode and leave (killed, every
    ``--kill-every``-th), ``--parallel`` at a time, until the servers are alone again each time."""
    from services.client import SidecarClient
    from supervise.processes import free_port, spawn_role

    def members_settled() -> bool:
        with SidecarClient(leader, timeout=2.0) as c:
            return sorted(c.status().get("members") or []) == ["ps0", "ps1"]

    for start in range(first, first + count, ns.parallel):
        running = []
        for i in range(start, min(start + ns.parallel, first + count)):
            slot, sidecar = i % ns.parallel, free_port()
            argv = ["trainer", "--name", f"trainer{slot}", "--sidecar-port", str(sidecar), *common,
                    "--num-trainers", str(ns.parallel), "--start", "--steps", str(ns.steps),
                    "--synthetic-tokens", str(TOKENS), "--batch-size", "10", "--bptt", "10"]
            running.append((i, spawn_role("supervise.cli", argv, root / f"trainer{slot}.log"),
                            f"http://127.0.0.1:{sidecar}"))
        for i, proc, url in running:
            poll_until(lambda: _episode_done(url) or proc.poll() is not None, 180, "a trainer's episode")
            if ns.kill_every and i % ns.kill_every == 0:
                proc.kill()
            else:
                proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        poll_until(members_settled, 60, "the servers alone in the group")


def _episode_done(url: str) -> bool:
    from services.client import SidecarClient
    with SidecarClient(url, timeout=2.0) as c:
        episode = c.status().get("episode") or {}
    return bool(episode.get("done"))
