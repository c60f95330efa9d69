"""``rpcps bench ring``: the trainers' all-reduce alone, on emulated hosts (needs root), to tell
what a ring all-reduce costs apart from what a host's CPU quota adds to it.

Each host runs one process that joins a gloo group of them all and all-reduces a tensor of
``--floats`` (by default the built-in DLRM's MLP gradients, as ``--dense allreduce`` hands
them over) ``--count`` times, in three settings, one after another:

* ``unlimited``: hosts without a quota: the ring's transfers and sums, the design's part;
* ``quota``: hosts of ``--cpus`` cores, nothing else to do: the ring under the quota;
* ``quota_with_work``: the same, each all-reduce after ``--work-ms`` of the process's own CPU
  (a trainer's step before it hands its gradients over): peers arrive as their quotas let them,
  and the ring waits for the last.

Each setting times two algorithms, all-reduce by all-reduce in turn: gloo's ring
(``dist.all_reduce``, 2 (hosts - 1) exchanges) and halving and doubling (``GroupSum`` of
``trainer/core/allreduce.py``, 2·log2(hosts) exchanges, two more where the count is not a power
of two), the trainers' sum where it saves 4 exchanges or more (from 6). Each all-reduce's seconds
on the clock and CPU seconds (every thread of the process) are reported per setting and
algorithm (median and 90th percentile over every host's), beside its exchanges. There is no
target: the figures explain the step-time model's hop and what fewer hops give.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

DLRM_FLOATS = 475_985       # the built-in DLRM's MLP parameters at its default sizes
PORT = 29_611               # the group's store, on the first host's own address
TIMEOUT = 600.0             # a setting's processes, from start to their last all-reduce


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=4, help="hosts in the ring (default: 4)")
    p.add_argument("--cpus", type=float, default=0.25, help="cores of each host with a quota (default: 0.25)")
    p.add_argument("--floats", type=int, default=DLRM_FLOATS,
                   help=f"float32 values all-reduced (default: {DLRM_FLOATS:,}, the built-in DLRM's MLPs)")
    p.add_argument("--count", type=int, default=30, help="all-reduces timed in each setting (default: 30)")
    p.add_argument("--work-ms", type=float, default=90.0,
                   help="CPU milliseconds each process spends before each all-reduce in the last setting (default: "
                        "90, a DLRM trainer's step at 2,048 samples)")


def _spend(seconds: float) -> None:
    """This thread on the CPU for ``seconds`` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def worker(rank: int, world: int, master: str, floats: int, count: int, work_s: float) -> dict[str, Any]:
    """One host's process: its all-reduces' seconds on the clock and of CPU, by algorithm."""
    import torch
    import torch.distributed as dist

    from trainer.core.allreduce import GroupSum
    torch.set_num_threads(1)
    store = dist.TCPStore(master, PORT, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    summing = GroupSum()
    algorithms = {"ring": dist.all_reduce, "halving_doubling": summing.halving_doubling}
    try:
        values = torch.ones(floats)
        for _ in range(3):             # the group's connections made before any is timed
            for sum_ in algorithms.values():
                sum_(values)
        dist.barrier()
        found: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in algorithms}
        for i in range(count):
            # In turn, each first as often: neither always comes after the other's wait.
            for name in (list(algorithms) if i % 2 == 0 else list(reversed(algorithms))):
                _spend(work_s)
                w0, c0 = time.perf_counter(), time.process_time()
                algorithms[name](values)
                found[name]["wall"].append(time.perf_counter() - w0)
                found[name]["cpu"].append(time.process_time() - c0)
        return {"rank": rank, **found}
    finally:
        dist.destroy_process_group()


def summary(results: list[dict[str, Any]], hops: int) -> dict[str, Any]:
    """Every host's all-reduces of one setting and algorithm in a few figures (milliseconds)."""
    wall = sorted(w for r in results for w in r["wall"])
    cpu = sorted(c for r in results for c in r["cpu"])
    p90 = wall[min(len(wall) - 1, int(0.9 * len(wall)))]
    median = statistics.median(wall)
    return {"wall_ms": round(median * 1e3, 3), "wall_ms_p90": round(p90 * 1e3, 3),
            "cpu_ms": round(statistics.median(cpu) * 1e3, 3), "hops": hops,
            "wall_ms_per_hop": round(median * 1e3 / hops, 3)}


def setting(hosts: int, cpus: Optional[float], ns: argparse.Namespace, work_s: float, folder: Path) -> dict[str, Any]:
    """One setting's processes, one per host, run to their end; each one's result."""
    from supervise.hosts.emulated import EmulatedHosts
    from trainer.core.allreduce import halving_doubling_rounds, ring_rounds
    names = [f"ring{i}" for i in range(hosts)]
    made = EmulatedHosts(names, cpus).create()
    try:
        master = made.address(names[0])
        procs = [made.python(name, __name__, ["--worker", str(rank), str(hosts), master, str(ns.floats),
                                               str(ns.count), str(work_s)], folder / f"{name}.log")
                 for rank, name in enumerate(names)]
        deadline = time.monotonic() + TIMEOUT
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
        results = []
        for name, proc in zip(names, procs):
            lines = [line for line in (folder / f"{name}.log").read_text().splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{name} failed ({proc.returncode}): "
                                   f"{(folder / f'{name}.log').read_text()[-2000:]}")
            results.append(json.loads(lines[-1]))
        return {"ring": summary([r["ring"] for r in results], ring_rounds(hosts)),
                "halving_doubling": summary([r["halving_doubling"] for r in results], halving_doubling_rounds(hosts)),
                "cpus": cpus, "work_ms": work_s * 1e3}
    finally:
        made.close()


def run(ns: argparse.Namespace) -> int:
    if ns.hosts < 2 or ns.count < 1 or ns.floats < 1 or ns.cpus <= 0 or ns.work_ms < 0:
        print(json.dumps({"bench": "ring", "error": "--hosts ≥ 2, --count ≥ 1, --floats ≥ 1, --cpus > 0 and "
                                                    "--work-ms ≥ 0"}))
        return 2
    runs = {}
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-ring-") as tmp:
        for name, cpus, work_s in (("unlimited", None, 0.0), ("quota", ns.cpus, 0.0),
                                   ("quota_with_work", ns.cpus, ns.work_ms / 1e3)):
            folder = Path(tmp) / name
            folder.mkdir()
            runs[name] = setting(ns.hosts, cpus, ns, work_s, folder)
            print(json.dumps({"bench": "ring", "kind": "setting", "setting": name, **runs[name]}), flush=True)
    base = runs["unlimited"]["ring"]["wall_ms"]
    ratios = {f"{k}_vs_unlimited": round(v["ring"]["wall_ms"] / base, 3) if base else None
              for k, v in runs.items() if k != "unlimited"}
    for k, v in runs.items():      # side by side, the same setting: below 1, halving and doubling waited less
        ring = v["ring"]["wall_ms"]
        ratios[f"{k}_halving_doubling_vs_ring"] = round(v["halving_doubling"]["wall_ms"] / ring, 3) if ring else None
    print(json.dumps({"bench": "ring", "hosts": ns.hosts, "bytes": ns.floats * 4, "count": ns.count, "settings": runs,
                      "ratios": ratios, "targets": {}, "met": {}}))
    return 0


def _main(argv: list[str]) -> None:
    """``python -m trainer.core.scale.bench_ring --worker RANK WORLD MASTER FLOATS COUNT WORK_S``."""
    rank, world, master, floats, count, work_s = argv
    print(json.dumps(worker(int(rank), int(world), master, int(floats), int(count), float(work_s))), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _main(sys.argv[2:])
