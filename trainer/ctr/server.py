"""What the parameter servers host for the CTR workload: its ``ModelSpec``, from their settings."""
from __future__ import annotations

from ps.spec import ModelSpec
from trainer.ctr.config import CtrServerConfig
from trainer.ctr.model import model_spec


def ctr_model(cfg: CtrServerConfig) -> ModelSpec:
    return model_spec(cfg.model())
