"""``rpcps bench read``: a schema's files read as a trainer reads them, from CSV and from Parquet,
the same records in both: the movies example's schema over ``rpcps data ratings`` samples
written each way, every record of one trainer's share encoded into batches (``--batch-size``), as
trainer 0 of ``--trainers`` reads them (every trainer decodes every record and keeps its own share).

Each format is read ``--repeats`` times, in turn, and its best pass counts (this machine is
shared): records per second of wall time and of this process's CPU time, which is what limits a
reader (one thread). Also checks that both formats give the same batches. Prints one JSON line;
``met.parquet_at_least_csv``: Parquet reads at least as many records a CPU second as CSV."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=300_000, help="samples written in each format")
    p.add_argument("--batch-size", type=int, default=1024, help="records a batch")
    p.add_argument("--row-group", type=int, default=8192, help="Parquet records a row group")
    p.add_argument("--trainers", type=int, default=1, help="read as trainer 0 of this many: its share only")
    p.add_argument("--repeats", type=int, default=3, help="passes over each format, in turn; the best counts")
    p.add_argument("--json", action="store_true", help="JSON only (the output is JSON anyway)")


def _share(schema: Any, data: Path, batch_size: int, shares: int) -> Any:
    """Trainer 0's batches of ``shares``, as a trainer reads them."""
    from rpcps.data.files import data_files
    from rpcps.data.formats import reader_of
    from rpcps.data.encoding import Encoder
    from rpcps.data.statistics import measure
    paths = data_files(data)
    return reader_of(schema).stream(Encoder(schema, measure(schema, paths)), paths, 0, shares).batches(batch_size)


def _pass(schema: Any, data: Path, batch_size: int, shares: int) -> tuple[int, float, float]:
    """(records, wall seconds, CPU seconds) of one pass."""
    wall, cpu = time.perf_counter(), time.process_time()
    records = sum(len(b) for b in _share(schema, data, batch_size, shares))
    return records, time.perf_counter() - wall, time.process_time() - cpu


def _same(a: Any, b: Any) -> bool:
    import torch
    return torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels) and all(
        torch.equal(a.sparse[f].values, b.sparse[f].values) and torch.equal(a.sparse[f].offsets, b.sparse[f].offsets)
        for f in a.sparse)


def run(args: argparse.Namespace) -> int:
    import torch

    import rpcps
    from rpcps.data.files import data_files
    from rpcps.data.statistics import named, rows_of, vocabularies
    from trainer.ctr import datagen_ratings
    from trainer.ctr.scale import EXAMPLES

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-read-") as tmp:
        out, sizes = Path(tmp), {}
        for fmt in ("csv", "parquet"):
            with open(os.devnull, "w") as quiet, redirect_stdout(quiet):     # its own summary line
                datagen_ratings.run(argparse.Namespace(rows=args.rows, out=out / fmt, files=1, gzip=False, users=6040,
                                                       movies=3706, seed=1, format=fmt, row_group=args.row_group))
            sizes[fmt] = sum(p.stat().st_size for p in data_files(out / fmt))
        csv = rpcps.load_schema(EXAMPLES / "movies_deepfm" / "movies.yaml")
        csv = vocabularies(csv, named(csv, rows_of(csv, data_files(out / "csv"), stop=10_000, logged=False)))
        schemas = {"csv": csv, "parquet": csv.model_copy(update={"format": "parquet"})}
        same = all(_same(a, b) for a, b in zip(*(_share(schemas[f], out / f, args.batch_size, args.trainers)
                                                 for f in ("csv", "parquet")), strict=True))
        passes: dict[str, list[tuple[int, float, float]]] = {"csv": [], "parquet": []}
        for _ in range(args.repeats):
            for fmt in passes:
                passes[fmt].append(_pass(schemas[fmt], out / fmt, args.batch_size, args.trainers))
    found = {}
    for fmt, runs in passes.items():
        records = runs[0][0]
        found[fmt] = {"records": records, "bytes": sizes[fmt],
                      "records_per_s": round(max(r / w for r, w, _ in runs)),
                      "records_per_cpu_s": round(max(r / c for r, _, c in runs)),
                      "cpu_share": round(max(c / w for _, w, c in runs), 2)}
    ratio = found["parquet"]["records_per_cpu_s"] / found["csv"]["records_per_cpu_s"]
    print(json.dumps({"bench": "read", **found, "parquet_over_csv": round(ratio, 2), "same_batches": same,
                      "met": {"parquet_at_least_csv": ratio >= 1.0, "same_batches": same},
                      "config": {"rows": args.rows, "batch_size": args.batch_size, "row_group": args.row_group,
                                 "trainers": args.trainers, "repeats": args.repeats, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}}),
          flush=True)
    return 0
