"""`rpcps ps` for the language model: the generic parameter server (``ps/``) hosting its model."""
from __future__ import annotations

from ps.role import PsRole
from ps.spec import ModelSpec
from services.role import RoleContext
from trainer.lm.config import LmModelConfig, LmServerConfig
from trainer.lm.data import vocab_size
from trainer.lm.model import model_spec


def lm_server(cfg: LmServerConfig, ctx: RoleContext) -> PsRole:
    def model() -> ModelSpec:
        ntoken = cfg.ntoken if cfg.ntoken is not None else vocab_size(cfg.data)
        return model_spec(LmModelConfig(ntoken=ntoken, emsize=cfg.emsize, nhid=cfg.nhid, nlayers=cfg.nlayers,
                                        init_range=cfg.init_range, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr))
    return PsRole(cfg, ctx, model)
