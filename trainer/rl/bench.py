"""``rpcps bench rl``: environment steps/s of the RL workload, batched and the seed's way.

Each configuration (1, 2 and 4 observers; batched and not) is a real ``rpcps up --workload rl``
from the same seed, fresh, for a fixed number of episodes. As in the seed's own benchmark, every
observer's episode is 200 CartPole-v1 steps (the environment restarts when it ends), so per-episode
costs weigh the same in every configuration and an episode's slowest observer does not leave the
others idle; ``--env CartPole-v1`` measures plain episodes. With the same observers
and seed, batched and one-at-a-time selection choose the same actions, so both modes play the same
episodes: the pair compares the same work. Steps/s counts the episodes after the warm-up: their
environment steps over their time. Configurations run interleaved, round by round, so the machine's
load drifts over all of them alike; the reported ratio is the median of the rounds' pair ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON only (the output is JSON either way)")
    p.add_argument("--observers", default="1,2,4", help="observer counts to measure, comma-separated")
    p.add_argument("--episodes", type=int, default=30, help="episodes per run, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="first episodes left out of steps/s")
    p.add_argument("--rounds", type=int, default=2, help="rounds over every configuration")
    p.add_argument("--seed", type=int, default=1, help="seed of every run")
    p.add_argument("--env", default="CartPole-v1:200", help="environment (default: CartPole-v1 restarted until 200 "
                                                              "steps, so every episode is the same work)")
    p.add_argument("--rpc-transport", default="uv", choices=("uv", "shm"), help="TensorPipe transport of every role")


def measure(observers: int, batched: bool, ns: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-rl-") as tmp:
        argv = [sys.executable, "-m", "supervise.cli", "up", "--workload", "rl", "--json", "--no-resume",
                "--observers", str(observers), "--batched" if batched else "--no-batched",
                "--episodes", str(ns.episodes), "--seed", str(ns.seed), "--env", ns.env,
                "--rpc-transport", ns.rpc_transport, "--no-final-checkpoint", "--state-dir", str(Path(tmp) / "state"),
                "--checkpoint-dir", str(Path(tmp) / "ckpt")]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    done = [e for e in events if e["event"] == "done"]
    if r.returncode != 0 or not done:
        raise RuntimeError(f"rpcps up --workload rl failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}")
    timed = [e for e in events if e["event"] == "progress" and e["episode"] > ns.warmup]
    steps = sum(e["env_steps"] for e in timed)
    seconds = sum(e["env_steps"] / e["steps_per_s"] for e in timed if e["steps_per_s"] > 0)
    return {"observers": observers, "batched": batched, "steps_per_s": steps / seconds if seconds else 0.0,
            "env_steps": steps, "episodes": len(timed),
            "mean_reward": sum(e["reward"] for e in timed) / len(timed) if timed else None}


def run(ns: argparse.Namespace) -> int:
    counts = [int(x) for x in ns.observers.split(",") if x]
    configs = [(n, b) for n in counts for b in (True, False)]
    rounds: list[dict[tuple[int, bool], dict]] = []
    for i in range(max(1, ns.rounds)):
        got = {}
        for n, b in (configs if i % 2 == 0 else list(reversed(configs))):
            got[(n, b)] = measure(n, b, ns)
            print(json.dumps({"round": i + 1, **got[(n, b)]}), file=sys.stderr, flush=True)
        rounds.append(got)
    results = []
    for n, b in configs:
        runs = [r[(n, b)] for r in rounds]
        results.append({"observers": n, "batched": b,
                        "steps_per_s": statistics.median(x["steps_per_s"] for x in runs),
                        "rounds": [round(x["steps_per_s"], 1) for x in runs],
                        "env_steps": runs[0]["env_steps"], "mean_reward": runs[0]["mean_reward"]})
    ratios = {str(n): statistics.median(r[(n, True)]["steps_per_s"] / r[(n, False)]["steps_per_s"] for r in rounds)
              for n in counts}
    print(json.dumps({"bench": "rl", "results": results, "batched_vs_not": ratios,
                      "target": {"batched_vs_not_at_4": 2.0},
                      "config": {"rpc_transport": ns.rpc_transport, "episodes": ns.episodes, "warmup": ns.warmup, "rounds": ns.rounds, "seed": ns.seed,
                                 "env": ns.env, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}}), flush=True)
    return 0
