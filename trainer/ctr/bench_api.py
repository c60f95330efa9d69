"""``rpcps bench api``: the DLRM written by hand against the internals (the built-in ``--workload
ctr`` model) beside the same DLRM written with the public API (``examples/criteo_dlrm``: a model
file and a schema), on the same Criteo-format files, in one process (``--local``) and on 2 servers
with 2 async trainers. Rounds interleave the runs (a b c d, then d c b a, …); the medians are reported,
and the API's samples/s over the built-in's, round by round, against the target of 0.95.

Run it from a checkout: the API's model is imported from ``examples/`` unless ``--model`` names
another on the path. Prints JSON lines, the last one the summary.
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

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TARGET = 0.95
VARIANTS = ("local", "async")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="criteo_dlrm.model:DLRM", help="the API's DLRM, as module:Class")
    p.add_argument("--schema", type=Path, default=EXAMPLES / "criteo_dlrm" / "criteo.yaml",
                   help="its schema: tables sized for --scale")
    p.add_argument("--scale", type=float, default=0.01, help="Criteo Kaggle's cardinalities times this")
    p.add_argument("--rows", type=int, default=100_000, help="lines of generated Criteo files to train on")
    p.add_argument("--steps", type=int, default=30, help="steps per trainer (local: steps of both trainers' samples)")
    p.add_argument("--batch-size", type=int, default=512, help="samples per trainer step")
    p.add_argument("--eval-samples", type=int, default=4096, help="held-out lines scored (the files' first)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every run")
    p.add_argument("--variants", default=",".join(VARIANTS), help="local, async, or both")


def _run(argv: list[str], tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(EXAMPLES), str(REPO),
                                                                   os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--json", "--state-dir", str(tmp / "state"),
                          "--checkpoint-dir", str(tmp / "ckpt"), "--no-final-checkpoint", "--no-resume",
                          "--progress-interval", "30", *argv], capture_output=True, text=True, env=env, timeout=3600)
    done = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"event": "done"')]
    if out.returncode != 0 or not done:
        raise RuntimeError(f"rpcps up {' '.join(argv)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return {"samples_per_s": done[-1]["samples_per_s"], "auc": done[-1]["auc"], "logloss": done[-1]["logloss"]}


def run(args: argparse.Namespace) -> int:
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"rpcps bench api: unknown variant {', '.join(unknown)}: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    common = ["--workload", "ctr", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--eval-samples", str(args.eval_samples), "--warmup-steps", "3"]
    models = {"builtin": ["--scale", str(args.scale)],
              "api": ["--model", args.model, "--schema", str(args.schema.resolve())]}
    results: dict[str, dict[str, list[dict]]] = {v: {m: [] for m in models} for v in variants}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "data"
        made = subprocess.run([sys.executable, "-m", "services.cli", "data", "ctr", "--rows", str(args.rows),
                               "--scale", str(args.scale), "--out", str(data)], capture_output=True, text=True)
        if made.returncode != 0:
            print(f"rpcps bench api: writing the data failed: {made.stderr}", file=sys.stderr)
            return 1
        for r in range(args.rounds):
            for variant in variants:
                where = ["--local"] if variant == "local" else ["--num-ps", "2", "--num-trainers", "2"]
                order = list(models.items())
                for model, flags in (order if r % 2 == 0 else order[::-1]):     # who goes first, in turn
                    found = _run([*common, *flags, *where, "--data", str(data)], tmp / f"{variant}-{model}-{r}")
                    results[variant][model].append(found)
                    print(json.dumps({"round": r + 1, "variant": variant, "model": model, **found}), flush=True)
    summary: dict = {"bench": "api", "args": {k: str(v) for k, v in vars(args).items() if k not in ("func",)},
                     "target_api_vs_builtin": TARGET}
    for variant in variants:
        runs = results[variant]
        ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs["api"], runs["builtin"])]
        summary[variant] = {m: {"samples_per_s": statistics.median(x["samples_per_s"] for x in found),
                                "auc": statistics.median(x["auc"] for x in found)} for m, found in runs.items()}
        summary[variant]["api_vs_builtin"] = statistics.median(ratios)
        summary[variant]["meets_target"] = statistics.median(ratios) >= TARGET
    print(json.dumps(summary), flush=True)
    return 0
