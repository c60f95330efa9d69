"""``rpcps bench cli``: how long the quick commands take to answer, against a real local cluster.

Each command runs as a new process, as a user types it, ``--runs`` times; the median is reported
beside the target (0.5 s). ``status`` and ``checkpoint --list`` read a small language-model cluster
this bench starts with ``rpcps up`` (and stops), with one checkpoint taken.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 0.5
COMMANDS = (("--help",), ("--version",), ("status",), ("checkpoint", "--list"), ("up", "--help"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=7, help="runs of each command; the median is reported (default: 7)")


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "supervise.cli", *argv]


def _start_cluster(folder: Path) -> subprocess.Popen:
    up = subprocess.Popen(_cli("up", "--json", "--emsize", "16", "--nhid", "16", "--synthetic-tokens", "20000",
                               "--num-ps", "1", "--num-trainers", "1"),
                          cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          start_new_session=True)
    for line in up.stdout:
        event = json.loads(line)
        if event["event"] == "started":
            return up
        if event["event"] == "error":
            raise RuntimeError(f"the cluster did not start: {event['message']}")
    raise RuntimeError(f"the cluster did not start (rpcps up exited with {up.wait()})")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-cli-") as tmp:
        folder = Path(tmp)
        # As a user's shell runs it: bytecode cached after the first run (a CI environment may say
        # PYTHONDONTWRITEBYTECODE, and then every run compiles every module again).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        up = _start_cluster(folder)
        try:
            subprocess.run(_cli("checkpoint"), cwd=folder, check=True, capture_output=True, timeout=120)
            seconds: dict[str, list[float]] = {}
            for _ in range(args.runs):           # interleaved: a busy moment costs every command alike
                for argv in COMMANDS:
                    t = time.perf_counter()
                    r = subprocess.run(_cli(*argv), cwd=folder, capture_output=True, timeout=60, env=env)
                    seconds.setdefault(" ".join(argv), []).append(time.perf_counter() - t)
                    if r.returncode != 0:
                        raise RuntimeError(f"rpcps {' '.join(argv)} exited with {r.returncode}: {r.stderr.decode()}")
        finally:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(60)
    medians = {cmd: round(statistics.median(s), 3) for cmd, s in seconds.items()}
    print(json.dumps({"bench": "cli", "runs": args.runs, "target_s": TARGET_S, "median_s": medians,
                      "worst_s": {cmd: round(max(s), 3) for cmd, s in seconds.items()},
                      "load_average": os.getloadavg()[0],
                      "met": all(medians[c] < TARGET_S for c in ("--help", "status", "checkpoint --list"))}))
    return 0
