"""``rpcps export``: a checkpoint of a model over a schema (the built-in DLRM, or a user's) as a
folder a program loads without any server (``rpcps.load_model``):

* ``weights.pt``: every table whole (a plain table's rows in id order; a hashed table's live raw
  ids and their rows), in fp32 whatever the servers stored, and every dense tensor;
* ``model.json``: the model's import path and arguments, the seed, the checkpoint and step it
  was taken from; ``schema.json``: the schema its inputs follow.

The model's code is not copied: loading imports it, as training did (an exported program would
need the model to trace, and a jagged input of data-dependent length does not). Any checkpoint
``rpcps checkpoint --list`` shows exports: full or a delta chain, from any number of servers, at
any table precision.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ps.server.export import whole_model
from rpcps.data.statistics import measured
from rpcps.model import models_from_here
from rpcps.saved import FORMAT, MODEL_FILE, write_model
from rpcps.schema import Schema
from rpcps.tables import bags_of
from services.checkpoint.store import CheckpointError, CheckpointInfo, CheckpointStore
from services.errors import ConfigError
from trainer.core.hosted import dense_parameters, hosted_spec, table_param
from trainer.ctr.custom import hosted_module


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=Path, metavar="PATH",
                   help="a checkpoint (a step-N folder), or a checkpoint folder: its newest checkpoint")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="the folder to write (new, or empty)")
    p.add_argument("--replace", action="store_true",
                   help="--out may hold a model exported before: it is replaced whole once the new one is written")
    p.add_argument("--data", type=Path, metavar="PATH",
                   help="the training files: a standardized column without a mean and std in the checkpoint's "
                        "schema is measured on their first records, as the trainers measured it, and recorded in "
                        "the export (a checkpoint of `rpcps up` holds them already; one without them is refused "
                        "without --data)")


def run(args: argparse.Namespace) -> int:
    models_from_here()
    try:
        summary = export(args.checkpoint, args.out, args.data, replace=args.replace)
    except (CheckpointError, ConfigError, ValueError) as exc:
        print(f"rpcps export: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def _checkpoint(path: Path) -> tuple[CheckpointStore, CheckpointInfo]:
    if (path / "manifest.json").is_file():
        store = CheckpointStore(path.parent)
        return store, store.resolve(path.name, verify=False)
    if not path.is_dir():
        raise ValueError(f"--checkpoint {path}: no such folder")
    found = CheckpointStore(path).list()
    if not found:
        raise ValueError(f"--checkpoint {path}: holds no checkpoint (rpcps checkpoint --list --checkpoint-dir {path})")
    return CheckpointStore(path), found[0]


def export(checkpoint: Path, out: Path, data: Optional[Path] = None, replace: bool = False) -> dict[str, Any]:
    """Write ``checkpoint``'s model to ``out`` (with ``data``, the training files, to measure
    standardized columns on; with ``replace``, over a model exported there before); what was
    written, in a few words."""
    exported_before = replace and (out / MODEL_FILE).is_file()
    if out.exists() and not exported_before and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty folder" +
                         (" or an exported model" if replace else " (--replace: over a model exported before)"))
    store, info = _checkpoint(checkpoint)
    hosted = info.meta.get("model", {})
    if "schema" not in hosted:
        raise ValueError(f"{info.id} holds a model that is not over a feature schema (the CTR workload's "
                         f"built-in DLRM or your --model): nothing here exports it")
    schema = measured(Schema.model_validate(hosted["schema"]), data)
    unmeasured = [n.column for n in schema.numeric if n.standardize and n.mean is None]
    if unmeasured:
        raise ValueError(f"{info.id}: standardized column {', '.join(unmeasured)} has no mean and std in the schema, "
                         f"and a model scores only as training read it: give --data (the training files), where they "
                         f"are measured as the trainers measured them")
    module = hosted_module(hosted)
    spec = hosted_spec(module, optimizer=hosted["optimizer"], lr=hosted["lr"], table_rule=hosted.get("table_rule"),
                       meta=hosted)
    gathered = whole_model(store, info, spec)
    tables: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, bag in bags_of(module):
        for name, cfg in bag.configs.items():
            rows = gathered.params[table_param(prefix, name)].float()
            if cfg.hashed:
                ids = gathered.hashed[name]["ids"]
                tables[table_param(prefix, name)] = {"ids": ids.clone(), "rows": rows[:len(ids)].clone()}
            else:
                tables[table_param(prefix, name)] = {"rows": rows.clone()}
    dense = {n: gathered.params[n].float().clone() for group in dense_parameters(module).values() for n, _ in group}
    described = {"format": FORMAT, "model": hosted["model"], "options": hosted.get("options") or {},
                 "seed": hosted["seed"], "checkpoint": info.id, "step": info.step, "taken_at": info.created,
                 "exported_at": time.time(), **({"criteo": hosted["criteo"]} if "criteo" in hosted else {})}
    write_model(out, tables, dense, described, schema)
    return {"exported": str(out), "checkpoint": info.id, "step": info.step, "model": hosted["model"],
            "tables": {t: int(v["rows"].shape[0]) for t, v in tables.items()}, "dense": len(dense)}
