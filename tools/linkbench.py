"""``python -m tools.linkbench``: the CTR cluster of docker-compose.yml's ``ctr`` profile with
every service on a host of its own, as the suite runs them (a network namespace each, and a PID
namespace per process, so every byte crosses the network: ``tests/support/netns.py``), each
host's link limited to each of ``--rates`` in turn (a token bucket out of its ``eth0``), and the
trainers run as each of ``--variants`` of ``rpcps bench ctr`` (its flags): samples/s, RPC bytes a
sample and a step's phases, beside plain ``async`` on the same link.

Needs root, iproute2's ``ip`` and ``tc``, and the test extras (``pip install -e '.[test]'``).
Variants run in rounds (a b c a b c …); medians are reported. Each run starts the cluster afresh
(no checkpoint), trains ``--steps`` steps of ``--batch-size`` samples on each trainer, and stops it
the way ``docker compose down`` does. The links add no delay: this needs netem, which not every
kernel has. Prints JSON lines, the last one the summary."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("ctr-ps0", "ctr-ps1", "ctr0", "ctr1")
TRAINERS = ("ctr0", "ctr1")
VARIANTS = ("async", "async-prefetch", "async-cache", "async-prefetch-cache", "sync", "sync-prefetch")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.linkbench", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="none,1gbit", help="comma-separated link rates in tc's units (none: no limit)")
    p.add_argument("--variants", default="async,async-prefetch,async-cache,async-prefetch-cache",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every rate and variant")
    p.add_argument("--scale", type=float, default=0.1, help="Criteo Kaggle's cardinalities times this")
    p.add_argument("--steps", type=int, default=60, help="steps per trainer")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of samples/s")
    p.add_argument("--batch-size", type=int, default=2048, help="samples per trainer step")
    ns = p.parse_args(argv)
    unknown = sorted(set(ns.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return ns


def trained(hosts, steps: int, timeout: float = 1200.0) -> dict[str, dict]:
    """Each trainer's /status once it has taken ``steps`` steps (before its evaluation moves on)."""
    from tests.support.hosts import get_json
    last: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hosts.alive()
        for name in TRAINERS:
            try:
                status = get_json(hosts.url(name, "/status"))
            except Exception:  # noqa: BLE001 - starting: not yet
                continue
            if status.get("step", 0) >= steps and name not in last:
                last[name] = status
        if len(last) == len(TRAINERS):
            return last
        time.sleep(0.5)  # noqa: sleep-ok (polling the trainers' status, bounded by the deadline)
    raise TimeoutError(f"the trainers did not take {steps} steps within {timeout:.0f}s")


def run_one(net, rate: str, variant: str, args: argparse.Namespace, tmp: Path) -> dict:
    from tests.support.deploy import compose
    from tests.support.hosts import Hosts
    from trainer.ctr.bench import extra
    for name in SERVICES:
        net.limit(name, None if rate == "none" else rate)
    flags = list(extra(variant, args.scale))
    environ = {"RPCPS_CTR_SCALE": str(args.scale)}
    if "--consistency" in flags:             # the servers' to know: compose passes it in their environment
        at = flags.index("--consistency")
        environ["RPCPS_CONSISTENCY"] = flags[at + 1]
        del flags[at:at + 2]
    flags += ["--steps", str(args.steps), "--warmup-steps", str(args.warmup), "--batch-size", str(args.batch_size),
              "--eval-samples", "1024"]
    services = {n: compose()["services"][n] for n in SERVICES}
    hosts = Hosts(net, services, tmp, environ)
    try:
        hosts.up(flags={t: flags for t in TRAINERS})
        status = trained(hosts, args.steps)
    finally:
        hosts.down()
    moved = [status[t]["moved"] for t in TRAINERS]
    steps = sum(m["steps"] for m in moved) or 1
    timed = moved[0].get("timed_steps") or 1
    cache = status["ctr0"].get("cache") or {}
    return {"samples_per_s": sum(status[t]["samples_per_s"] for t in TRAINERS),
            "bytes_per_sample": sum(m["rpc_bytes"] for m in moved) / steps / args.batch_size,
            "saved_bytes_per_sample": sum(m.get("bytes_saved", 0) for m in moved) / steps / args.batch_size,
            "cache_hit_rate": cache.get("hit_rate"),
            "step_ms": {p: round(1e3 * s / timed, 1) for p, s in moved[0].get("phase_seconds", {}).items()}}


def main(argv: list[str]) -> int:
    args = parse(argv)
    sys.path.insert(0, str(REPO))
    from tests.support.netns import HostNetwork
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    net = HostNetwork(list(SERVICES)).create()
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for i in range(args.rounds):
            for rate in rates:
                for variant in variants:
                    with tempfile.TemporaryDirectory(prefix="rpcps-linkbench-") as tmp:
                        result = run_one(net, rate, variant, args, Path(tmp))
                    runs.setdefault((rate, variant), []).append(result)
                    print(json.dumps({"bench": "link", "round": i, "rate": rate, "variant": variant, **result}),
                          flush=True)
    finally:
        net.close()
    summary: dict[str, dict] = {}
    for (rate, variant), results in runs.items():
        row = {k: statistics.median(r[k] for r in results) for k in ("samples_per_s", "bytes_per_sample",
                                                                       "saved_bytes_per_sample")}
        if results[-1]["cache_hit_rate"] is not None:
            row["cache_hit_rate"] = statistics.median(r["cache_hit_rate"] for r in results)
        row["step_ms"] = results[-1]["step_ms"]
        plain = runs.get((rate, "async"))
        if plain:       # side by side: each round's run beside plain async's of the same round
            row["vs_async"] = statistics.median(r["samples_per_s"] / p["samples_per_s"] for r, p in zip(results, plain))
        summary.setdefault(rate, {})[variant] = row
    print(json.dumps({"bench": "link", "results": summary,
                      "config": {**vars(args), "trainers": 2, "servers": 2,
                                 "cpus": os.cpu_count(), "load_avg": os.getloadavg()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
