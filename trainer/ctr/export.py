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
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ps.server.export import whole_model
from rpcps.saved import FORMAT, MODEL_FILE, SCHEMA_FILE, WEIGHTS_FILE
from rpcps.tables import bags_of
from services.checkpoint.store import CheckpointError, CheckpointInfo, CheckpointStore
from services.errors import ConfigError
from trainer.core.hosted import dense_parameters, hosted_spec, table_param
from trainer.ctr.custom import hosted_module


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=Path, metavar="PATH",
                   help="a checkpoint (a step-N folder), or a checkpoint folder: its newest checkpoint")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="the folder to write (new, or empty)")


def run(args: argparse.Namespace) -> int:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())   # the model's module, found from here as `rpcps up`'s roles found it
    try:
        summary = export(args.checkpoint, args.out)
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


def export(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Write ``checkpoint``'s model to ``out``; what was written, in a few words."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty folder")
    store, info = _checkpoint(checkpoint)
    hosted = info.meta.get("model", {})
    if "schema" not in hosted:
        raise ValueError(f"{info.id} holds a model that is not over a feature schema (the CTR workload's "
                         f"built-in DLRM or your --model): nothing here exports it")
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
                 "seed": hosted["seed"], "checkpoint": info.id, "step": info.step, "exported_at": time.time()}
    # Written beside, then moved in place: a failed export leaves no half-written model.
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save({"format": FORMAT, "tables": tables, "dense": dense}, partial / WEIGHTS_FILE)
    (partial / MODEL_FILE).write_text(json.dumps(described, indent=2) + "\n")
    (partial / SCHEMA_FILE).write_text(json.dumps(hosted["schema"], indent=2) + "\n")
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return {"exported": str(out), "checkpoint": info.id, "step": info.step, "model": hosted["model"],
            "tables": {t: int(v["rows"].shape[0]) for t, v in tables.items()}, "dense": len(dense)}
