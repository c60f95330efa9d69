"""``rpcps data check --schema S --data D``: read the first training records of data files as a
schema says, and show each column as the model will see it (cardinality, missing rate, list
lengths, value range) and each table as its rows will hold the values (how many share a row, and
the same advice `rpcps up` gives), so a user sees their data before training on it. Exit 0: every
record read; 1: some records are malformed (each reason is printed; training would skip and count
them); 2: the schema or the files cannot be used, hold no record, or hold fewer records to train on
than ``--num-trainers`` (`rpcps up` refuses them too)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAMPLE = 10_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schema", type=Path, required=True, help="the feature schema (YAML or TOML)")
    p.add_argument("--data", type=Path, required=True, help="a data file in the schema's format (CSV, TSV or "
                                                            "Parquet), or a folder of them")
    p.add_argument("--lines", type=int, default=SAMPLE, help="records to read, from the first training record on")
    p.add_argument("--num-trainers", "--trainers", type=int, default=2,
                   help="the trainers `rpcps up` would start (its default, 2): fewer records to train on is an error")
    p.add_argument("--eval-samples", type=int, default=0,
                   help="the first records `rpcps up --eval-samples` would hold out: read from the one after")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def summary(schema, paths: list[Path], count: int, held: int = 0) -> dict:
    import numpy as np

    from rpcps.data.encoding import Encoder, transformed, values_of
    from rpcps.data.statistics import measure, named, occupancy, rows_of, vocabularies
    from trainer.ctr.preflight import sharing

    stream = rows_of(schema, paths, start=held, stop=held + count, logged=False)
    rows = list(stream)
    out: dict = {"lines": len(rows) + stream.skipped, "from_record": held, "malformed": stream.skipped, "reasons": stream.reasons,
                 "label": {"column": schema.label,
                           "positive_rate": float(np.mean([r.label for r in rows])) if rows else None},
                 "numeric": [], "categorical": []}
    stats = measure(schema, paths, count)
    for j, n in enumerate(schema.numeric):
        raw = [r.numeric[j] for r in rows]
        x = transformed(np.array([n.fill if v is None else v for v in raw], dtype=np.float64), n)
        entry = {"column": n.column, "missing_rate": _share(sum(v is None for v in raw), len(raw))}
        if len(x):
            entry.update(min=float(x.min()), max=float(x.max()), mean=float(x.mean()), std=float(x.std()))
        if n.standardize:
            mean, std = (n.mean, n.std) if n.mean is not None else stats[n.column]
            entry["standardized_by"] = {"mean": mean, "std": std, "measured": n.mean is None}
        out["numeric"].append(entry)
    tables = {t.name: t for t in schema.tables}
    for j, c in enumerate(schema.categorical):
        lists = [values_of(r.categorical[j], c.separator) for r in rows]
        lengths = np.array([len(v) for v in lists])
        table = tables[c.table_name]
        entry = {"feature": c.name, "column": c.column, "table": table.name,
                 "rows": table.rows, "hashed": table.hashed,
                 "distinct": len({v for values in lists for v in values}),
                 "missing_rate": _share(int((lengths == 0).sum()), len(lists))}
        if c.separator is not None and len(lengths):
            entry.update(mean_length=float(lengths.mean()), max_length=int(lengths.max()),
                         truncated_rate=_share(int((lengths > c.max_length).sum()), len(lists)))
        out["categorical"].append(entry)
    advice = sharing(schema, rows, held)
    out["tables"] = [{"table": o.table, "rows": o.rows, "hashed": o.rows == 0, "distinct": o.distinct,
                      "rows_used": o.rows_used, "sharing": o.sharing, "advice": advice.get(o.table)}
                     for o in occupancy(schema, rows)]
    if rows:       # what a trainer makes of them (a vocabulary as these lines would make it)
        Encoder(vocabularies(schema, named(schema, rows)), stats).batch(rows[:8])
    return out


def _share(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def _table(s: dict) -> str:
    start = f" from record {s['from_record']}" if s["from_record"] else ""
    lines = [f"{s['lines']} records read{start}, {s['malformed']} malformed"]
    lines += [f"  {why}" for why in s["reasons"]]
    if s["label"]["positive_rate"] is not None:
        lines.append(f"label {s['label']['column']}: {s['label']['positive_rate']:.1%} positive")
    if s["numeric"]:
        lines.append(f"{'numeric':<20}{'missing':>9}{'min':>12}{'max':>12}{'mean':>12}{'std':>12}")
        for n in s["numeric"]:
            values = "".join(f"{n[k]:>12.4g}" for k in ("min", "max", "mean", "std")) if "min" in n else ""
            lines.append(f"{n['column']:<20}{n['missing_rate']:>9.1%}{values}"
                         + (" (standardized)" if "standardized_by" in n else ""))
    lines.append(f"{'feature':<20}{'table':<14}{'rows':>10}{'distinct':>10}{'missing':>9}{'lengths':>16}")
    for c in s["categorical"]:
        size = "hashed" if c["hashed"] else str(c["rows"])
        lengths = f"{c['mean_length']:.2f} (max {c['max_length']})" if "mean_length" in c else "one"
        note = f", {c['truncated_rate']:.1%} cut" if c.get("truncated_rate") else ""
        lines.append(f"{c['feature']:<20}{c['table']:<14}{size:>10}{c['distinct']:>10}{c['missing_rate']:>9.1%}"
                     f"{lengths:>16}{note}")
    lines.append(f"{'table':<20}{'rows':>10}{'distinct':>10}{'rows used':>11}{'sharing':>9}")
    for t in s["tables"]:
        size = "hashed" if t["hashed"] else str(t["rows"])
        note = "  values share rows: they train as one (below)" if t["advice"] else ""
        lines.append(f"{t['table']:<20}{size:>10}{t['distinct']:>10}{t['rows_used']:>11}{t['sharing']:>9}{note}")
    lines += [t["advice"] for t in s["tables"] if t["advice"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from rpcps.schema import SchemaError, load_schema
    from rpcps.data.lines import LineError
    from rpcps.data.files import data_files
    from rpcps.data.statistics import check
    from services.errors import ConfigError
    from trainer.ctr.preflight import held_out

    try:
        schema = load_schema(args.schema)
        if not args.data.exists():
            raise LineError(f"{args.data} does not exist")
        paths = data_files(args.data)
        if not paths:
            raise LineError(f"{args.data} holds no data files")
        if schema.header:
            check(schema, paths, 1)          # every file's header: a malformed line is counted, not fatal
    except (SchemaError, LineError) as exc:
        print(f"rpcps data check: {exc}", file=sys.stderr)
        return 2
    s = summary(schema, paths, args.lines, args.eval_samples)
    if not s["lines"]:
        print(f"rpcps data check: {args.data} holds no record" + (" (only a header)" if schema.header else "")
              + (f" past the {args.eval_samples} held out" if args.eval_samples else ""), file=sys.stderr)
        return 2
    print(json.dumps(s) if args.json else _table(s), flush=True)
    try:       # the records rpcps up would train on, by its own rule
        held_out(schema, paths, args.eval_samples, args.num_trainers, flag="--num-trainers")
    except ConfigError as exc:
        print(f"rpcps data check: {exc}", file=sys.stderr)
        return 2
    return 1 if s["malformed"] else 0
