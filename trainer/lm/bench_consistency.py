"""``rpcps bench consistency``: the three consistency modes side by side, with and without stragglers.

Each run is ``rpcps up`` with two servers and two trainers on the default model, every trainer the
same number of steps (so every run trains on the same number of tokens), then the held-out loss of
the trainers' held-out shares. Each mode (async, sync, ssp:2) runs in three settings: plain; with
trainer0 at half speed on every step (the straggler); and with every trainer slowed N-fold on a
random fraction of its steps (jitter: the transient stragglers of a shared machine). The nine runs
go in rounds; ratios are taken within a round and the median reported. Prints JSON lines, the
last one the summary.

A bound that holds ties the fast trainer to a persistent straggler once its K+1-step lead is spent:
over S steps ssp:K can gain at most (K+1)/(2S) on sync there. SSP's gain is against jitter, where
the trainers are slow at different times and the lead absorbs it; sync waits for the slower of
them at every step.
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
SETTINGS = ("plain", "straggler", "jitter")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=40, rounds="the nine runs")
    p.add_argument("--slow-down", type=float, default=2.0, help="the straggler runs at 1/N speed")
    p.add_argument("--jitter", type=float, default=5.0, help="jitter slows a step N-fold ...")
    p.add_argument("--jitter-fraction", type=float, default=0.25, help="... on this fraction of every trainer's steps")
    p.add_argument("--eval-tokens", type=int, default=20_000, help="held-out tokens evaluated (both trainers)")


def _one(args: dict, data: Path | None, mode: str, slowing: tuple[str, ...], eval_tokens: int) -> dict:
    d = run_up(args, data, ("--consistency", mode, *slowing), eval_tokens)
    return {"tokens_per_s": d["tokens_per_s"], "loss": d["val_loss"], "train_loss_last": d["loss_last"],
            "tokens": d["total_steps"] * args["batch_size"] * args["bptt"]}


def run(ns: argparse.Namespace) -> int:
    data, args = data_of(ns), model_args(ns)
    rounds = []
    for i in range(ns.rounds):
        result: dict = {kind: {} for kind in SETTINGS}
        slowing = {"plain": (), "straggler": ("--straggler", str(ns.slow_down)),
                   "jitter": ("--jitter", str(ns.jitter), "--jitter-fraction", str(ns.jitter_fraction))}
        for kind in SETTINGS:
            for mode in MODES:
                result[kind][mode] = _one(args, data, mode, slowing[kind], ns.eval_tokens)
                print(json.dumps({"bench": "consistency", "round": i, "setting": kind, "mode": mode,
                                  **result[kind][mode]}), flush=True)
        rounds.append(result)

    def median(kind: str, mode: str, key: str) -> float:
        return statistics.median(r[kind][mode][key] for r in rounds)

    def ratio(kind: str, a: str, b: str) -> float:
        return statistics.median(r[kind][a]["tokens_per_s"] / r[kind][b]["tokens_per_s"] for r in rounds)

    ratios = {"sync_vs_async": ratio("plain", "sync", "async"),
              "straggler_ssp:2_vs_sync": ratio("straggler", "ssp:2", "sync"),
              "jitter_ssp:2_vs_sync": ratio("jitter", "ssp:2", "sync")}
    table = {kind: {mode: {"tokens_per_s": median(kind, mode, "tokens_per_s"), "loss": median(kind, mode, "loss")}
                    for mode in MODES} for kind in SETTINGS}
    print(json.dumps({"bench": "consistency", "results": table["plain"], "straggler": table["straggler"],
                      "jitter": table["jitter"], "ratios": ratios, "targets": TARGETS,
                      "met": {k: ratios[k] >= v for k, v in TARGETS.items()},
                      "config": {**args, "data": str(data) if data else "synthetic", "rounds": ns.rounds,
                                 "slow_down": ns.slow_down, "jitter": ns.jitter,
                                 "jitter_fraction": ns.jitter_fraction, "eval_tokens": ns.eval_tokens, "cpus": os.cpu_count(),
                                 "load_avg": os.getloadavg()}}), flush=True)
    return 0
