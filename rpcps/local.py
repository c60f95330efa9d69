"""Training a model in one process, with the update rules the servers use: the baseline a
cluster is compared with, and the way to debug a model before it goes to one."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ps.spec.rules import RuleOptimizer, rule
from rpcps.tables import bags_of


def local_optimizer(model: nn.Module, optimizer: str = "sgd", lr: float = 0.1,
                    table_rule: Optional[str] = None) -> RuleOptimizer:
    """An optimizer over ``model``'s parameters (its tables built here first) that steps each
    table by its ``rule`` (else by ``table_rule``, else by ``optimizer``) and everything else by
    ``optimizer`` (sgd, adagrad; tables also rowwise_adagrad), as the servers would:
    ``zero_grad()``, ``loss.backward()``, ``step()``."""
    tables = {}
    for _, bag in bags_of(model):
        bag.materialize()
        for name, cfg in bag.configs.items():
            tables[id(bag.weights[name])] = rule(cfg.rule or table_rule or optimizer)
    dense = rule(optimizer)
    return RuleOptimizer([(p, tables.get(id(p), dense)) for p in model.parameters()], lr)
