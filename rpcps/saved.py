"""A trained model taken out of the cluster (``rpcps export``), loaded where no server runs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from rpcps.model import build_model
from rpcps.schema import Schema
from rpcps.tables import bags_of

FORMAT = 1
WEIGHTS_FILE, MODEL_FILE, SCHEMA_FILE = "weights.pt", "model.json", "schema.json"


def load_model(path: "str | Path") -> nn.Module:
    """The model ``rpcps export`` wrote to ``path``, built by its own code (importable here, as it
    was in training) and holding the trained weights, in eval mode: ``model(batch)`` as in
    training. A hashed table reads zeros for an id it has no row for, as the servers' evaluation
    does; ``model.schema`` is the schema its batches follow."""
    path = Path(path)
    try:
        described = json.loads((path / MODEL_FILE).read_text())
        schema = Schema.model_validate(json.loads((path / SCHEMA_FILE).read_text()))
        weights = torch.load(path / WEIGHTS_FILE, weights_only=True)
    except FileNotFoundError as exc:
        raise ValueError(f"{path} is not an exported model: {Path(exc.filename).name} is missing") from None
    if described.get("format") != FORMAT or weights.get("format") != FORMAT:
        raise ValueError(f"{path}: exported in format {described.get('format')}, this version reads {FORMAT}")
    model = build_model(described["model"], schema, int(described["seed"]), described.get("options"))
    for prefix, bag in bags_of(model):
        for name in bag.configs:
            saved = weights["tables"][f"{prefix}weights.{name}"]
            bag.load_rows(name, saved["rows"], saved.get("ids"))
    missing, unexpected = model.load_state_dict(weights["dense"], strict=False)
    missing = [n for n in missing if not any(n.startswith(f"{prefix}weights.") for prefix, _ in bags_of(model))]
    if missing or unexpected:
        raise ValueError(f"{path}: the weights do not fit {described['model']}: missing {missing}, "
                         f"unexpected {unexpected}")
    model.schema = schema
    model.exported = described
    return model.eval()


def write_model(out: Path, tables: dict[str, dict[str, torch.Tensor]], dense: dict[str, torch.Tensor],
                described: dict[str, Any], schema: Schema) -> None:
    """The folder ``load_model`` reads: ``tables`` by parameter name (``rows``, and a hashed
    table's raw ``ids``), the ``dense`` tensors, the model as ``described``, and its ``schema``.
    Written beside ``out`` and moved in place, so a failed write leaves no half-written model; a
    model already at ``out`` is moved aside first and removed after."""
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save({"format": FORMAT, "tables": tables, "dense": dense}, partial / WEIGHTS_FILE)
    (partial / MODEL_FILE).write_text(json.dumps(described, indent=2) + "\n")
    (partial / SCHEMA_FILE).write_text(json.dumps(schema.model_dump(mode="json"), indent=2) + "\n")
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)
