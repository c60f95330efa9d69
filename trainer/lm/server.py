"""What the parameter servers host for the language model: its ``ModelSpec``, from their settings."""
from __future__ import annotations

from ps.spec.model import ModelSpec
from trainer.lm.config import LmModelConfig, LmServerConfig
from trainer.lm.data import vocab_size
from trainer.lm.model import model_spec


def lm_model(cfg: LmServerConfig) -> ModelSpec:
    ntoken = cfg.ntoken if cfg.ntoken is not None else vocab_size(cfg.data)
    return model_spec(LmModelConfig(ntoken=ntoken, emsize=cfg.emsize, nhid=cfg.nhid, nlayers=cfg.nlayers,
                                    init_range=cfg.init_range, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr))
