"""``rpcps bench consistency``: the three consistency modes side by side, with and without a straggler.

Each run is ``rpcps up`` with two servers and two trainers on the default model, every trainer the
same number of steps (so every run trains on the same number of tokens), then the held-out loss of
the trainers' held-out shares. The six runs (async, sync, ssp:2; then the same with trainer0 at
half speed) go in rounds, ``a b c a' b' c'`` each round; ratios are taken within a round and the
median reported. Prints JSON lines, the last one the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from trainer.lm.bench import add_model_arguments, data_of, model_args, run_up

MODES = ("async", "sync", "ssp:2")
TARGETS = {"sync_vs_async": 0.85, "straggler_ssp:2_vs_sync": 1.3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=40, rounds="the six runs")
    p.add_argument("--slow-down", type=float, default=2.0, help="the straggler runs at 1/N speed")
    p.add_argument("--eval-tokens", type=int, default=20_000, help="held-out tokens evaluated (both trainers)")


def _one(args: dict, data: Path | None, mode: str, slow: float, eval_tokens: int) -> dict:
    extra = ("--consistency", mode) + (("--straggler", str(slow)) if slow > 1 else ())
    d = run_up(args, data, extra, eval_tokens)
    return {"tokens_per_s": d["tokens_per_s"], "loss": d["val_loss"], "train_loss_last": d["loss_last"],
            "tokens": d["total_steps"] * args["batch_size"] * args["bptt"]}


def run(ns: argparse.Namespace) -> int:
    data, args = data_of(ns), model_args(ns)
    rounds = []
    for i in range(ns.rounds):
        result: dict = {"plain": {}, "straggler": {}}
        for kind, slow in (("plain", 1.0), ("straggler", ns.slow_down)):
            for mode in MODES:
                result[kind][mode] = _one(args, data, mode, slow, ns.eval_tokens)
                print(json.dumps({"bench": "consistency", "round": i, "straggler": slow, "mode": mode,
                                  **result[kind][mode]}), flush=True)
        rounds.append(result)

    def median(kind: str, mode: str, key: str) -> float:
        return statistics.median(r[kind][mode][key] for r in rounds)

    ratios = {"sync_vs_async": statistics.median(r["plain"]["sync"]["tokens_per_s"] / r["plain"]["async"]["tokens_per_s"]
                                                 for r in rounds),
              "straggler_ssp:2_vs_sync": statistics.median(
                  r["straggler"]["ssp:2"]["tokens_per_s"] / r["straggler"]["sync"]["tokens_per_s"] for r in rounds)}
    table = {kind: {mode: {"tokens_per_s": median(kind, mode, "tokens_per_s"), "loss": median(kind, mode, "loss")}
                    for mode in MODES} for kind in ("plain", "straggler")}
    print(json.dumps({"bench": "consistency", "results": table["plain"], "straggler": table["straggler"],
                      "ratios": ratios, "targets": TARGETS,
                      "met": {k: ratios[k] >= v for k, v in TARGETS.items()},
                      "config": {**args, "data": str(data) if data else "synthetic", "rounds": ns.rounds,
                                 "slow_down": ns.slow_down, "eval_tokens": ns.eval_tokens, "cpus": os.cpu_count(),
                                 "load_avg": os.getloadavg()}}), flush=True)
    return 0
