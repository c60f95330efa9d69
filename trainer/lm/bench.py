"""``rpcps bench lm``: language-model tokens/s three ways, side by side in one run.

(a) ``local``: the same model in one process, no RPC, torch using every core;
(b) ``seed``: the seed tutorial's design (logits over RPC, one server, one trainer);
(c) ``rpcps``: ``rpcps up`` with two servers and two trainers on this machine;
(d) ``rpcps-allreduce``: the same with ``--dense allreduce --consistency sync``: the LSTM replicated
    on the trainers, only the embedding and decoder rows over RPC.

The ``rpcps`` variants also report what a trainer's step moves (``bytes_per_step``: tensor bytes to
and from the servers over RPC, and bytes handed to the trainers' all-reduce).

Each variant runs in its own processes, one after the other, ``--rounds`` times (a b c a b c …);
ratios are taken within a round and the median reported. Prints JSON lines, the last one the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# A WikiText-2 folder to benchmark on unless --data names one (the synthetic corpus without either).
WIKITEXT_VARIABLE = "RPCPS_WIKITEXT"
WIKITEXT2_NTOKEN = 33_278  # WikiText-2's full (train+valid+test) vocabulary, the classic example's size
TARGETS = {"rpcps_vs_local": 0.9, "rpcps_vs_seed": 1.5}


def add_model_arguments(p: argparse.ArgumentParser, steps: int, rounds: str) -> None:
    """The flags every language-model bench takes: output, data, model size, steps, rounds."""
    p.add_argument("--json", action="store_true", help="JSON lines only (the default output is JSON too)")
    p.add_argument("--data", type=Path, default=None,
                   help=f"WikiText-style folder (default: the folder ${WIKITEXT_VARIABLE} names, if set; else the "
                        f"synthetic corpus)")
    p.add_argument("--ntoken", type=int, default=WIKITEXT2_NTOKEN, help="vocabulary rows")
    p.add_argument("--steps", type=int, default=steps, help="steps per trainer, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    p.add_argument("--rounds", type=int, default=1, help=f"rounds of {rounds}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=30, rounds="a, b, c, d")
    p.add_argument("--variants", default="local,seed,rpcps,rpcps-allreduce", help="comma-separated subset to run")


def poll_until(probe: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """``probe``'s first truthy answer (an exception counts as none: not up yet); a bench that
    waits past ``timeout`` ends, saying for what."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen = probe()
            if seen:
                return seen
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(interval)  # noqa: sleep-ok (polling inside a deadline)
    raise SystemExit(f"rpcps bench: gave up after {timeout:.0f}s waiting for {what}")


def sidecar_ready(url: str) -> bool:
    from services.client import SidecarClient
    with SidecarClient(url, timeout=2.0) as c:
        return c.ready()


def data_of(ns: argparse.Namespace) -> Path | None:
    named = os.environ.get(WIKITEXT_VARIABLE)
    return ns.data if ns.data is not None else (Path(named) if named else None)


def model_args(args: argparse.Namespace) -> dict:
    return {"ntoken": args.ntoken, "emsize": 200, "nhid": 200, "nlayers": 2, "dropout": 0.2, "bptt": 35,
            "batch_size": 20, "steps": args.steps, "warmup": args.warmup}


def _tokens(data: Path | None, ntoken: int):
    from trainer.lm.data import Corpus
    corpus = Corpus.load(data)
    if corpus.ntoken > ntoken:
        raise SystemExit(f"--ntoken {ntoken} is smaller than the corpus vocabulary {corpus.ntoken}")
    return corpus.train


def bench_local(args: dict, data: Path | None) -> dict:
    """One process, every core: the reference throughput."""
    import torch
    from trainer.lm.config import LmModelConfig
    from trainer.lm.data import BatchStream, batchify
    from trainer.lm.model import LocalLM, init_hidden

    torch.set_num_threads(os.cpu_count() or 1)
    model_cfg = LmModelConfig(ntoken=args["ntoken"], emsize=args["emsize"], nhid=args["nhid"], nlayers=args["nlayers"])
    model = LocalLM(model_cfg, args["dropout"])
    stream = BatchStream(batchify(_tokens(data, args["ntoken"]), args["batch_size"]), args["bptt"])
    hidden = init_hidden(model_cfg, args["batch_size"])
    times, loss = [], None
    for _ in range(args["steps"]):
        x, y, _ = stream.next()
        t0 = time.perf_counter()
        loss, hidden = model.train_step(x, y, hidden, clip=0.25)
        times.append(time.perf_counter() - t0)
    timed = times[args["warmup"]:]
    return {"tokens_per_s": x.numel() * len(timed) / sum(timed), "timed_steps": len(timed), "threads": torch.get_num_threads(),
            "step_s_median": statistics.median(timed), "loss_last": loss}


def bench_seed(args: dict, data: Path | None) -> dict:
    from trainer.lm.bench_seed import run_seed
    from supervise.processes import free_port
    from trainer.lm.data import batchify

    tokens = batchify(_tokens(data, args["ntoken"]), args["batch_size"])
    with tempfile.TemporaryDirectory() as tmp:
        return run_seed(tokens, {**args, "threads": 1}, free_port(), str(Path(tmp) / "seed.json"))


def run_up(args: dict, data: Path | None, extra: tuple[str, ...] = (), eval_tokens: int = 1) -> dict:
    """``rpcps up`` with two servers and two trainers, to its end: its ``done`` event."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "supervise.cli", "up", "--json", "--ps", "2", "--trainers", "2",
                "--steps", str(args["steps"]), "--warmup-steps", str(args["warmup"]), "--ntoken", str(args["ntoken"]),
                "--eval-tokens", str(eval_tokens), "--state-dir", str(Path(tmp) / "state"),
                "--progress-interval", "30", "--checkpoint-dir", str(Path(tmp) / "ckpt"), *extra]
        if data is not None:
            argv += ["--data", str(data)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        done = [e for e in lines if e.get("event") == "done"]
        if r.returncode != 0 or not done:
            raise RuntimeError(f"rpcps up failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}")
        return done[-1]


def bench_rpcps(args: dict, data: Path | None, extra: tuple[str, ...] = ()) -> dict:
    d = run_up(args, data, extra)
    return {"tokens_per_s": d["tokens_per_s"], "timed_steps": d["steps"] - args["warmup"], "servers": 2,
            "trainers": 2, "loss_last": d["loss_last"], "bytes_per_step": d["bytes_per_step"]}


def bench_rpcps_allreduce(args: dict, data: Path | None) -> dict:
    return bench_rpcps(args, data, ("--dense", "allreduce", "--consistency", "sync"))


VARIANTS = {"local": bench_local, "seed": bench_seed, "rpcps": bench_rpcps, "rpcps-allreduce": bench_rpcps_allreduce}


def _run_variant(name: str, args: dict, data: Path | None) -> dict:
    """Each variant in a fresh interpreter, so thread settings and allocations never leak between them."""
    argv = [sys.executable, "-m", "trainer.lm.bench", name, json.dumps(args), str(data) if data else ""]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"variant {name} failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(ns: argparse.Namespace) -> int:
    data, args = data_of(ns), model_args(ns)
    names = [v for v in ns.variants.split(",") if v]
    rounds = []
    for i in range(ns.rounds):
        result = {}
        for name in names:
            result[name] = _run_variant(name, args, data)
            print(json.dumps({"bench": "lm", "round": i, "variant": name, **result[name]}), flush=True)
        rounds.append(result)
    ratios = {}
    for key, (num, den) in {"rpcps_vs_local": ("rpcps", "local"), "rpcps_vs_seed": ("rpcps", "seed"),
                            "allreduce_vs_rpcps": ("rpcps-allreduce", "rpcps")}.items():
        pairs = [r[num]["tokens_per_s"] / r[den]["tokens_per_s"] for r in rounds if num in r and den in r]
        if pairs:
            ratios[key] = statistics.median(pairs)
    results = {n: {"tokens_per_s": statistics.median(r[n]["tokens_per_s"] for r in rounds), "runs": [r[n] for r in rounds]}
               for n in names}
    summary = {"bench": "lm", "results": results, "ratios": ratios, "targets": TARGETS,
               "met": {k: ratios[k] >= v for k, v in TARGETS.items() if k in ratios},
               "config": {**args, "data": str(data) if data else "synthetic", "rounds": ns.rounds,
                          "cpus": os.cpu_count(), "load_avg": os.getloadavg()}}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    variant, raw, data_arg = sys.argv[1], sys.argv[2], sys.argv[3]
    print(json.dumps(VARIANTS[variant](json.loads(raw), Path(data_arg) if data_arg else None)))
