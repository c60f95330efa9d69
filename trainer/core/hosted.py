"""A plain ``nn.Module`` holding ``rpcps.EmbeddingBags``, on the parameter servers: what they host
is derived from the module (``hosted_spec``), and a trainer runs the module unchanged over the
rows and weights it fetched (``HostedModel``).

* Each table of each ``EmbeddingBags`` becomes a ``Table`` whose parameter is named as the module
  names it in one process (``<path>.weights.<table>``), its rows built from (seed, table, row).
* Every other parameter is dense: each child module's parameters (and the model's own) form a
  dense group, placed on the servers in turn; their initial values are the module's own, so every
  process must build it the same way (the same code and seed).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from ps.spec.model import DenseGroup, Lifecycle, ModelSpec, Table
from ps.client.client import PsClient
from rpcps.tables import EmbeddingBags, TableConfig, bags_of, serving
from services.errors import ConfigError
from trainer.core.served import ServedModel


def table_param(prefix: str, table: str) -> str:
    return f"{prefix}weights.{table}"


def _table(bag: EmbeddingBags, cfg: TableConfig, param: str, rule: Optional[str]) -> Table:
    life = Lifecycle(admit_after=cfg.admit_after, evict_after_steps=cfg.evict_after_steps) if cfg.hashed else None
    return Table(cfg.rows, {param: (cfg.dim,)}, lambda ids: {param: bag.initial_rows(cfg.name, ids)},
                 rule=cfg.rule or rule,
                 placement="" if cfg.placement == "auto" else cfg.placement, hashed=life, dtype=cfg.dtype,
                 wire_dtype=cfg.wire_dtype)


def dense_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The parameters not in a table, by the child module that holds them ("": the model's own)."""
    in_tables = {id(p) for _, bag in bags_of(model) for p in bag.parameters()}
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if id(p) not in in_tables:
            groups.setdefault(name.split(".")[0] if "." in name else "", []).append((name, p))
    return groups


def describe(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint and a trainer check the servers' model against: its tables and dense shapes."""
    return {"tables": {table_param(prefix, name): cfg.model_dump(mode="json")
                       for prefix, bag in bags_of(model) for name, cfg in bag.configs.items()},
            "dense": {name: list(p.shape) for group in dense_parameters(model).values() for name, p in group}}


def restorable(model: nn.Module, optimizer: str, table_rule: Optional[str]) -> dict[str, Any]:
    """What a checkpoint must match to restore into ``model``: each table's rows, width, keying
    and update rule (whose state it holds), and the dense shapes. The rest may change from run to
    run, as a checkpoint restores into it: a hashed table's capacity (its rows are saved by id),
    storage and wire precision, placement, admission, eviction, pooling."""
    return {"tables": {table_param(prefix, name): {"rows": None if cfg.hashed else cfg.rows, "dim": cfg.dim,
                                                   "hashed": cfg.hashed, "rule": cfg.rule or table_rule or optimizer}
                       for prefix, bag in bags_of(model) for name, cfg in bag.configs.items()},
            "dense": describe(model)["dense"]}


def hosted_spec(model: nn.Module, *, optimizer: str = "sgd", lr: float = 0.1, table_rule: Optional[str] = None,
                meta: Optional[dict[str, Any]] = None) -> ModelSpec:
    """What the servers host for ``model``: its tables and its dense parameters as they are now,
    stepped by ``optimizer`` at ``lr``, each table by its own rule when it names one, else by
    ``table_rule``, else by ``optimizer``.
    ``meta``: what else the model says of itself (the servers report it; trainers read it back)."""
    tables: dict[str, Table] = {}
    for prefix, bag in bags_of(model):
        for name, cfg in bag.configs.items():
            if name in tables:
                raise ConfigError(f"two tables of the model are named {name}: a table's name is the model's to give once")
            tables[name] = _table(bag, cfg, table_param(prefix, name), table_rule)
    if not tables:
        raise ConfigError(f"{type(model).__name__} holds no rpcps.EmbeddingBags: nothing for the servers to host")
    groups = tuple(DenseGroup({n: tuple(p.shape) for n, p in params},
                              lambda params=params: {n: p.detach().clone() for n, p in params})
                   for params in dense_parameters(model).values())
    return ModelSpec(tables, groups, optimizer=optimizer, lr=lr,
                     meta={**(meta or {}), **describe(model), "optimizer": optimizer, "lr": lr,
                           "table_rule": table_rule, "restorable": restorable(model, optimizer, table_rule)},
                     compatible=("restorable",))


class HostedModel(ServedModel):
    """``module`` run by a trainer whose servers host it: each step fetches the rows of the batch's
    ids and the dense weights (unless replicated here) in one round, then runs ``module`` over them."""

    def __init__(self, client: PsClient, module: nn.Module) -> None:
        mine, theirs = describe(module), {k: client.model.get(k) for k in ("tables", "dense")}
        if mine != theirs:
            differ = sorted(k for k in mine if mine[k] != theirs[k])
            raise ConfigError(f"the servers host another model than {type(module).__name__}: its {' and '.join(differ)} "
                              f"differ (the servers': {theirs}; this trainer's: {mine})")
        super().__init__(client, module)
        self.bags = [(prefix, bag) for prefix, bag in bags_of(module)]

    def lookups(self, features: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The rows ``features`` name: table parameter -> ids."""
        return {table_param(prefix, table): ids for prefix, bag in self.bags
                for table, ids in bag.lookups(features).items()}

    def fetch(self, features: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The rows of the ids ``features`` name, and the dense weights, from the servers."""
        return self.fetch_rows(self.lookups(features))

    def run(self, fetched: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], *inputs: Any) -> Any:
        """``module(*inputs)`` over what ``fetch`` gave."""
        rows, weights = fetched
        given = [(bag, {table: rows[table_param(prefix, table)] for table in bag.configs}) for prefix, bag in self.bags]
        with serving(given):
            return self.run_dense(weights, *inputs)
