"""What the parameter servers host for the CTR workload: its ``ModelSpec``, from their settings: the
built-in DLRM, or a user's model over a schema (``--model``, ``--schema``)."""
from __future__ import annotations

from ps.spec.model import ModelSpec
from trainer.ctr.config import CtrServerConfig
from trainer.ctr.model import model_spec


def ctr_model(cfg: CtrServerConfig) -> ModelSpec:
    if cfg.user_model:
        from trainer.ctr.custom import user_model_spec
        return user_model_spec(cfg.user_model, cfg.loaded_schema(), seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr,
                               table_rule=cfg.table_rule)
    return model_spec(cfg.model())
