"""Exported models written without a cluster, their tables' rows as initialised: the tests'
ratings model over its schema (the age column's mean and std given, as `rpcps export --data`
records them; its hashed table holding rows for users 0 to 49 only), and the built-in DLRM at a
tiny scale with two tables keyed by raw ids (holding no rows)."""
import time
from pathlib import Path

import torch

from rpcps.data.encoding import value_id
from rpcps.model import build_model
from rpcps.saved import FORMAT, write_model
from rpcps.schema import load_schema
from rpcps.tables import bags_of

HERE = Path(__file__).resolve().parent
MODEL = "tests.support.ratings_model:RatingsModel"
KNOWN_USERS = 50


def schema():
    loaded = load_schema(HERE / "ratings_schema.yaml")
    numeric = tuple(n.model_copy(update={"mean": 35.0, "std": 12.0}) if n.column == "age" else n
                    for n in loaded.numeric)
    return loaded.model_copy(update={"numeric": numeric})


def _write(out: Path, ref: str, s, options: dict, step: int, **more) -> Path:
    module = build_model(ref, s, 3, options)
    tables = {}
    for prefix, bag in bags_of(module):
        for name, cfg in bag.configs.items():
            if cfg.hashed:
                ids = torch.tensor([value_id(name, str(u)) for u in range(KNOWN_USERS if ref == MODEL else 0)],
                                   dtype=torch.int64)
                tables[f"{prefix}weights.{name}"] = {"ids": ids, "rows": bag.initial_rows(name, ids)}
            else:
                tables[f"{prefix}weights.{name}"] = {"rows": bag.initial_rows(name, torch.arange(cfg.rows))}
    dense = {n: p.detach().clone() for n, p in module.named_parameters() if ".weights." not in f".{n}"}
    now = time.time()
    write_model(out, tables, dense, {"format": FORMAT, "model": ref, "options": options, "seed": 3,
                                     "checkpoint": f"step-{step}", "step": step, "taken_at": now - 5,
                                     "exported_at": now, **more}, s)
    return out


def write_exported(out: Path, step: int = 7) -> Path:
    return _write(out, MODEL, schema(), {}, step)


def write_builtin(out: Path, step: int = 4) -> Path:
    """The built-in DLRM at scale 0.0005, tables C3 and C12 keyed by raw ids."""
    from trainer.ctr.builtin import named
    from trainer.ctr.config import CtrModelSettings
    ref, s, options, more = named(CtrModelSettings(scale=0.0005, dim=4, bottom="8", top="8", tables="C3,C12"))
    return _write(out, ref, s, options, step, **more)
