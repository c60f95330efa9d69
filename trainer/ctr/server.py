"""What the parameter servers host for the CTR workload: its ``ModelSpec``, from their settings: the
built-in DLRM over Criteo's format, or a user's model over a schema (``--model``, ``--schema``)."""
from __future__ import annotations

from ps.spec.model import ModelSpec
from trainer.ctr import builtin
from trainer.ctr.config import CtrServerConfig
from trainer.ctr.custom import schema_model_spec


def ctr_model(cfg: CtrServerConfig) -> ModelSpec:
    ref, schema, options, more = builtin.named(cfg)
    return schema_model_spec(ref, schema, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr,
                             table_rule=cfg.table_rule, options=options, **more)
