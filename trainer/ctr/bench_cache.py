"""``rpcps bench cache``: a CTR trainer's rows cache (``--cache-rows``, ``--cache-staleness``)
alone, without servers, on the generated Criteo batches one of 2 trainers takes (``--scale``,
``--batch-size``): how much of each step it would give.

* For the biggest tables, with a share of their rows cached (``--shares``, as ``--cache-share``
  keeps them), at each staleness (``--staleness``; ``inf``: unbounded, as async allows): the hit
  rate counted by a step's distinct ids (each a row not read from the servers: what
  ``/status``'s ``cache.hit_rate`` counts, and what saves bytes) and by lookups (each id as
  often as the batch names it, as HET counts its cache's hits).
* Over all 26 tables with ``--cache-rows`` rows each and ``--cache-staleness``: the
  milliseconds a step spends taking copies and keeping the rows read (one thread), and the
  hit rate by distinct ids (as ``rpcps bench ctr``'s cache variants report it).

The rows kept are stand-ins (the cache never looks at them); the first ``--warmup`` steps fill
the cache and are left out. Prints one JSON line."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

UNBOUNDED = 1 << 40                # steps: more than any run takes
TARGET_LOOKUP_HIT_RATE = 0.85      # with 1 % of a big table's rows cached


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=float, default=0.1, help="Criteo Kaggle's cardinalities times this")
    p.add_argument("--batch-size", type=int, default=2048, help="samples per trainer step")
    p.add_argument("--steps", type=int, default=60, help="steps, the warm-up among them")
    p.add_argument("--warmup", type=int, default=20, help="first steps left out (the cache filling)")
    p.add_argument("--tables", type=int, default=2, help="how many of the biggest tables to report one by one")
    p.add_argument("--shares", default="0.01,0.05", help="comma-separated shares of a table's rows cached")
    p.add_argument("--staleness", default="1,10,inf", help="comma-separated bounds in steps (inf: unbounded)")
    p.add_argument("--cache-rows", type=int, default=10_000, help="the all-tables run: rows cached per table")
    p.add_argument("--cache-staleness", type=int, default=10, help="the all-tables run: its bound in steps")
    p.add_argument("--json", action="store_true", help="JSON only (the output is JSON anyway)")


def _bound(word: str) -> int:
    return UNBOUNDED if word.strip() in ("inf", "unbounded") else int(word)


def _rates(counts: Any) -> dict[str, float]:
    """A cache's hit rates (its ``CacheCounts``) by distinct ids and by lookups."""
    return {"ids": round(counts.hits / max(1, counts.hits + counts.misses), 4),
            "lookups": round(counts.hit_lookups / max(1, counts.lookups), 4)}


def _replay(batches: list[Any], sizes: list[int], tables: list[int], cache: Any, warmup: int
            ) -> tuple[dict[str, float], list[float], list[float]]:
    """``cache`` (a ``HotRows``) over ``batches`` (id tensors [samples, tables]) for columns
    ``tables`` (of ``sizes`` rows each): its hit rates after the warm-up, and each counted step's
    seconds taking and storing."""
    import torch

    took, stored = [], []
    for step, batch in enumerate(batches):
        t0 = time.perf_counter()
        taken = {t: cache.take(f"C{t + 1}", batch[:, t], step) for t in tables}
        t1 = time.perf_counter()
        for t, got in taken.items():
            cache.store(f"C{t + 1}", got.miss_ids, torch.zeros(got.miss_ids.numel(), 16), step, sizes[t])
        t2 = time.perf_counter()
        if step >= warmup:
            for t, got in taken.items():
                cache.count(f"C{t + 1}", got)
            took.append(t1 - t0)
            stored.append(t2 - t1)
    return _rates(cache.counts), took, stored


def run(args: argparse.Namespace) -> int:
    if args.steps <= args.warmup:
        raise SystemExit("rpcps bench cache: --steps must be more than --warmup")
    import torch

    from ps.client.cache import HotRows
    from rpcps.data.generated import GeneratedSource
    from rpcps.data.generated import SyntheticCtr
    torch.set_num_threads(1)
    generator = SyntheticCtr(seed=1, scale=args.scale)
    source = GeneratedSource(generator, args.batch_size, 0, 2)
    batches = [torch.as_tensor(source.samples().ids) for _ in range(args.steps)]
    sizes = generator.cardinalities
    biggest = sorted(range(len(sizes)), key=lambda t: -sizes[t])[:args.tables]
    bounds = [b.strip() for b in args.staleness.split(",") if b.strip()]
    per_table = {}
    for t in biggest:
        by_share = {}
        for share in [float(s) for s in args.shares.split(",") if s.strip()]:
            by_share[str(share)] = {f"S={b}": _replay(batches, sizes, [t], HotRows(0, _bound(b), share),
                                                      args.warmup)[0] for b in bounds}
        per_table[f"C{t + 1}"] = {"rows": sizes[t], "hit_rate": by_share}
    rates, took, stored = _replay(batches, sizes, list(range(len(sizes))), HotRows(args.cache_rows, args.cache_staleness),
                                  args.warmup)
    one_percent = [r["hit_rate"].get("0.01", {}).get(f"S={b}", {}).get("lookups") for r in per_table.values()
                   for b in bounds]
    print(json.dumps({
        "bench": "cache", "tables": per_table,
        "all_tables": {"cache_rows": args.cache_rows, "cache_staleness": args.cache_staleness,
                       "hit_rate": rates, "take_ms_per_step": round(1e3 * statistics.median(took), 2),
                       "store_ms_per_step": round(1e3 * statistics.median(stored), 2)},
        "target": {"lookup_hit_rate_at_1pct": TARGET_LOOKUP_HIT_RATE,
                   "met": any(r is not None and r >= TARGET_LOOKUP_HIT_RATE for r in one_percent)},
        "config": {"scale": args.scale, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                   "cpus": os.cpu_count(), "load_avg": os.getloadavg()}}), flush=True)
    return 0
