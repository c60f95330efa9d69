"""``rpcps data ctr``: the generated Criteo-shaped samples written as Criteo TSV files (plain or
gzip), so a user sees the format ``--data`` reads and can test a pipeline of their own with them.
Sample ``i`` of the files is sample ``i`` of the generator (seed, scale), the same data
``rpcps up --workload ctr`` trains on without ``--data``."""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, required=True, help="samples (lines) to write in all")
    p.add_argument("--out", type=Path, required=True, help="folder to write the files into (made if missing)")
    p.add_argument("--files", type=int, default=1, help="split the lines over this many files (day_0, day_1, …)")
    p.add_argument("--gzip", action="store_true", help="write day_K.gz instead of day_K.tsv")
    p.add_argument("--scale", type=float, default=1.0, help="the generator's tables: Criteo Kaggle's cardinalities "
                                                           "times this (ids are written as hashed 32-bit values)")
    p.add_argument("--seed", type=int, default=1, help="which data set (its hidden ground truth and samples): "
                                                       "the trainers' --data-seed")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from rpcps.data.criteo import write
    from rpcps.data.generated import SyntheticCtr

    if args.rows < 1 or args.files < 1 or args.files > args.rows:
        print("rpcps data ctr: --rows must be at least 1 and at least --files", file=sys.stderr)
        return 2
    if not 0 < args.scale <= 1:
        print("rpcps data ctr: --scale must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"rpcps data ctr: cannot make {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    generator = SyntheticCtr(seed=args.seed, scale=args.scale)
    started, written, files = time.monotonic(), 0, []
    bounds = np.linspace(0, args.rows, args.files + 1).astype(np.int64)
    for k in range(args.files):
        path = args.out / (f"day_{k}.gz" if args.gzip else f"day_{k}.tsv")
        with (gzip.open(path, "wt", encoding="utf-8") if args.gzip else open(path, "w", encoding="utf-8")) as f:
            lines = write(generator, np.arange(bounds[k], bounds[k + 1], dtype=np.int64), f)
        written += lines
        files.append({"path": str(path), "lines": lines, "bytes": path.stat().st_size})
    print(json.dumps({"data": "ctr", "rows": written, "files": files, "seed": args.seed, "scale": args.scale,
                      "seconds": round(time.monotonic() - started, 2)}), flush=True)
    return 0
