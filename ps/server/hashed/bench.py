"""``rpcps bench embeddings``: a hashed table against a plain row-wise one, in one server process.

A Zipf stream of raw ids over ``--id-space`` (10⁹) values, in batches of ``--batch-size`` × 26 ids
(deduplicated, as trainers send them), goes to one server (a ``ParameterServer``, no RPC) holding
two tables of ``--capacity`` rows and dimension D, both stepped by row-wise Adagrad:

* **hashed**: keyed by the raw ids, admitting each at once, evicting the least used at capacity;
* **plain**: the same ids modulo its rows, as a table without an index takes them.

Each batch is looked up and updated in both, alternately, and timed as the server times its own
work (inside its lock): the rows/s of each, side by side. The hashed table looks each batch up
twice: first as it comes (``admit_rows_per_s``: new ids get rows, at capacity some are evicted),
then again, every id known (``gather_rows_per_s``, against the plain table's gather). Also: the
hashed table's bytes a row (values, row-wise state, index, bookkeeping and the delta checkpoints'
mark) against the bound D·4 + 4 + 24, its highest occupancy, and its slowest batch among those
that evicted. With ``--half fp16`` (the default),
each dimension runs again with both tables stored in half precision, updated with stochastic
rounding (``fp16`` in the summary, against the bound D·2 + 4 + 24). After the first dimension's
run, ``delta_vs_full``: the server's full checkpoint file, then, once 1 % of each table's rows
are looked up and updated, its delta, each copied and written to disk (``--checkpoint-dir``):
bytes and seconds. Prints JSON lines, the last one the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Iterator

FEATURES = 26
TARGET = 0.7          # hashed rows/s at least this share of the plain table's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON lines only (the default output is JSON too)")
    p.add_argument("--capacity", type=int, default=5_000_000, help="rows of each table")
    p.add_argument("--dims", default="16,64", help="comma-separated row widths, one run each")
    p.add_argument("--batches", type=int, default=450, help="batches per run (about 330 fill 5 M rows)")
    p.add_argument("--batch-size", type=int, default=2048, help="samples per batch (26 ids each)")
    p.add_argument("--id-space", type=float, default=1e9, help="distinct raw ids the stream draws from")
    p.add_argument("--zipf", type=float, default=1.05, help="the stream's Zipf exponent")
    p.add_argument("--warmup", type=int, default=5, help="first batches left out of rows/s")
    p.add_argument("--checkpoint-dir", default=None, help="where delta_vs_full writes (default: a temporary "
                                                           "folder, removed after)")
    p.add_argument("--half", choices=("fp16", "bf16", ""), default="fp16",
                   help="also run each dimension with the rows in this half precision ('': not)")


def stream(batches: int, per_batch: int, id_space: int, exponent: float, seed: int = 0) -> Iterator[Any]:
    """Batches of distinct raw ids: Zipf ranks over ``id_space``, each rank scrambled to a 64-bit id."""
    import numpy as np
    import torch
    rng = np.random.default_rng(seed)
    for _ in range(batches):
        ranks = rng.zipf(exponent, per_batch * FEATURES * 2)
        ranks = ranks[ranks <= id_space][:per_batch * FEATURES]
        with np.errstate(over="ignore"):
            raw = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x5DEECE66D)
        yield torch.from_numpy(np.unique(raw.view(np.int64)))


def _server(capacity: int, dim: int, dtype: str) -> Any:
    import torch
    from prometheus_client import CollectorRegistry

    from ps.spec.model import Lifecycle
    from ps.server.metrics import PsMetrics
    from ps.server.service import ParameterServer
    from ps.spec.model import ModelSpec, Table

    def init(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {name: torch.rand(ids.numel(), dim, generator=g) * 0.01 for name in ("hashed.weight", "plain.weight")}
    spec = ModelSpec({"hashed": Table(capacity, {"hashed.weight": (dim,)}, init, rule="rowwise_adagrad",
                                      hashed=Lifecycle(), dtype=dtype),
                      "plain": Table(capacity, {"plain.weight": (dim,)}, init, rule="rowwise_adagrad", dtype=dtype)},
                     lr=0.01)
    return ParameterServer("ps0", 0, 1, spec, PsMetrics(CollectorRegistry(), "ps", "ps0"))


def run_dim(args: argparse.Namespace, dim: int, dtype: str = "fp32", delta: bool = False) -> dict:
    import torch
    torch.set_num_threads(1)
    server = _server(args.capacity, dim, dtype)
    hashed, plain = server.param("hashed.weight"), server.param("plain.weight")
    table = server.hashed.tables["hashed"]
    times = {k: 0.0 for k in ("hashed_admit", "hashed_gather", "hashed_update", "plain_gather", "plain_update")}
    rows = {"hashed": 0, "plain": 0}
    occupancy_max, evict_max, evicting_batches = 0.0, 0.0, 0
    for k, ids in enumerate(stream(args.batches, args.batch_size, int(args.id_space), args.zipf)):
        timed = k >= args.warmup
        rounds = table.evict_rounds
        with server.optimizer.lock:
            t0 = time.perf_counter()
            out, read = server.hashed.lookup("hashed", "hashed.weight", ids, server.optimizer.steps)
            ta = time.perf_counter()
            # The same ids again, now known: what a lookup costs once the ids have rows.
            out, read = server.hashed.lookup("hashed", "hashed.weight", ids, server.optimizer.steps)
            t1 = time.perf_counter()
            local = ids.remainder(args.capacity)
            plain_out = server.params.row_shard("plain.weight")(local)
            t2 = time.perf_counter()
        if table.evict_rounds != rounds:
            evict_max, evicting_batches = max(evict_max, ta - t0), evicting_batches + 1
        occupancy_max = max(occupancy_max, len(table) / table.capacity)
        hashed_grad = torch.sparse_coo_tensor(read.rows[None], torch.ones(read.rows.numel(), dim), hashed.shape)
        plain_grad = torch.sparse_coo_tensor(local[None], torch.ones(local.numel(), dim), plain.shape)
        t3 = time.perf_counter()
        server.optimizer.apply({hashed: hashed_grad})
        t4 = time.perf_counter()
        server.optimizer.apply({plain: plain_grad})
        t5 = time.perf_counter()
        if timed:
            times["hashed_admit"] += ta - t0
            times["hashed_gather"] += t1 - ta
            times["plain_gather"] += t2 - t1
            times["hashed_update"] += t4 - t3
            times["plain_update"] += t5 - t4
            rows["hashed"] += read.rows.numel()
            rows["plain"] += plain_out.shape[0]
        del out
    state_bytes = sum(v.element_size() * v[0].numel() for v in server.optimizer.state_of(hashed).values()
                      if v.dim() > 0)
    marks = server.params.touched.marks["hashed"].element_size()      # what changed, for delta checkpoints
    bytes_per_row = hashed.element_size() * dim + state_bytes + table.nbytes / table.capacity + marks
    result = {"dim": dim, "dtype": dtype, "capacity": table.capacity, "rows": len(table),
              "occupancy_max": occupancy_max,
              "admitted": table.counts.admitted, "evicted": table.counts.evicted,
              "bytes_per_row": bytes_per_row, "bytes_per_row_bound": dim * hashed.element_size() + 4 + 24,
              "admit_rows_per_s": rows["hashed"] / times["hashed_admit"],
              "gather_rows_per_s": rows["hashed"] / times["hashed_gather"],
              "update_rows_per_s": rows["hashed"] / times["hashed_update"],
              "plain_gather_rows_per_s": rows["plain"] / times["plain_gather"],
              "plain_update_rows_per_s": rows["plain"] / times["plain_update"],
              "evict_step_max_s": evict_max, "evicting_batches": evicting_batches}
    result["gather_vs_plain"] = result["gather_rows_per_s"] / result["plain_gather_rows_per_s"]
    result["update_vs_plain"] = result["update_rows_per_s"] / result["plain_update_rows_per_s"]
    if delta:
        result["delta_vs_full"] = delta_vs_full(server, args, dim)
    return result


def delta_vs_full(server: Any, args: argparse.Namespace, dim: int) -> dict:
    """A full checkpoint file of ``server``, then a delta after 1 % of each table's rows changed:
    the time to copy and write each, and their bytes."""
    import tempfile
    from pathlib import Path

    import torch

    from services.checkpoint.store import CheckpointStore
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as folder:
        store = CheckpointStore(Path(folder))

        def save(step: int, since: Any) -> tuple[int, float]:
            started = time.perf_counter()
            state = server.export_state(since=since)
            store.prepare(step)
            entry = store.write_file(step, "ps0.pt", state)
            seconds = time.perf_counter() - started
            with server.optimizer.lock:
                server.params.touched.settle(True, step)
            assert ("delta" in state) == (since is not None)
            return entry.size, seconds
        full_bytes, full_s = save(server.optimizer.steps, None)
        hashed_ids, _ = server.hashed.tables["hashed"].index.rows()
        some = hashed_ids[torch.randperm(hashed_ids.numel())[:args.capacity // 100]]
        _, read = server.hashed.lookup("hashed", "hashed.weight", some, server.optimizer.steps)
        plain_rows = torch.randperm(args.capacity)[:args.capacity // 100]
        hashed, plain = server.param("hashed.weight"), server.param("plain.weight")
        server.optimizer.apply({
            hashed: torch.sparse_coo_tensor(read.rows[None], torch.ones(read.rows.numel(), dim), hashed.shape),
            plain: torch.sparse_coo_tensor(plain_rows[None], torch.ones(plain_rows.numel(), dim), plain.shape)})
        delta_bytes, delta_s = save(server.optimizer.steps, server.params.touched.since)
    return {"bytes": delta_bytes / full_bytes, "seconds": delta_s / full_s, "full_bytes": full_bytes,
            "delta_bytes": delta_bytes, "full_s": full_s, "delta_s": delta_s, "changed": 0.01}


def run(args: argparse.Namespace) -> int:
    results, halves = [], []
    for k, dim in enumerate(int(d) for d in args.dims.split(",") if d):
        for dtype, into in (("fp32", results), (args.half, halves)):
            if dtype:
                into.append(run_dim(args, dim, dtype, delta=k == 0 and dtype == "fp32"))
                print(json.dumps({"bench": "embeddings", **into[-1]}), flush=True)
    first = results[0]
    half = {"dtype": args.half, **{k: {r["dim"]: r[k] for r in halves} for k in (
        "bytes_per_row", "bytes_per_row_bound", "gather_rows_per_s", "update_rows_per_s", "gather_vs_plain",
        "update_vs_plain")}} if halves else None
    print(json.dumps({
        "bench": "embeddings", "bytes_per_row": {r["dim"]: r["bytes_per_row"] for r in results},
        "bytes_per_row_bound": {r["dim"]: r["bytes_per_row_bound"] for r in results},
        "occupancy_max": max(r["occupancy_max"] for r in results), "capacity": first["capacity"],
        "admit_rows_per_s": {r["dim"]: r["admit_rows_per_s"] for r in results},
        "gather_rows_per_s": {r["dim"]: r["gather_rows_per_s"] for r in results},
        "update_rows_per_s": {r["dim"]: r["update_rows_per_s"] for r in results},
        "plain_gather_rows_per_s": {r["dim"]: r["plain_gather_rows_per_s"] for r in results},
        "plain_update_rows_per_s": {r["dim"]: r["plain_update_rows_per_s"] for r in results},
        "evict_step_max_s": max(r["evict_step_max_s"] for r in results),
        "delta_vs_full": first["delta_vs_full"], "fp16": half,
        "target": TARGET,
        "met": {"bytes_per_row": all(r["bytes_per_row"] <= r["bytes_per_row_bound"] for r in results),
                "occupancy": all(r["occupancy_max"] <= 1.0 for r in results),
                "gather": all(r["gather_vs_plain"] >= TARGET for r in results),
                "update": all(r["update_vs_plain"] >= TARGET for r in results),
                "fp16_bytes_per_row": all(r["bytes_per_row"] <= r["bytes_per_row_bound"] for r in halves)
                if halves else None,
                "delta_vs_full": max(first["delta_vs_full"]["bytes"], first["delta_vs_full"]["seconds"]) <= 0.1},
        "config": {"batches": args.batches, "batch_size": args.batch_size, "features": FEATURES, "id_space": args.id_space,
                   "zipf": args.zipf, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}}), flush=True)
    return 0
