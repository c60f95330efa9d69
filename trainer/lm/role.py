"""The language-model trainer: the shared trainer role (``trainer/core/role.py``) over its share
of a corpus, read before it joins."""
from __future__ import annotations

import logging

from ps.client.client import PsClient
from services.errors import PeerUnavailable
from services.names import parse_name
from services.role import RoleContext
from trainer.core.role import ServedTrainer
from trainer.lm.config import TrainerConfig
from trainer.lm.data import BatchStream, Corpus, trainer_share
from trainer.lm.model import DistributedLM
from trainer.lm.task import LmTask

log = logging.getLogger(__name__)


class TrainerRole(ServedTrainer):
    role = "trainer"

    def __init__(self, cfg: TrainerConfig, ctx: RoleContext) -> None:
        super().__init__(cfg, ctx)
        self.cfg: TrainerConfig = cfg

    def prepare(self) -> None:
        cfg = self.cfg
        self.corpus = Corpus.load(cfg.data, synthetic_tokens=cfg.synthetic_tokens, seed=cfg.seed)
        index = parse_name(cfg.name).index % cfg.num_trainers
        self.train, self.heldout = trainer_share(self.corpus, index, cfg.num_trainers, cfg.batch_size,
                                                 cfg.eval_tokens, cfg.eval_batch_size)
        log.info("data: %s; share %d of %d: %d training tokens", self.corpus.description, index, cfg.num_trainers,
                 self.train.numel())

    def evaluates(self) -> bool:
        return self.heldout is not None

    def task(self, client: PsClient) -> LmTask:
        model = DistributedLM(client, self.cfg.dropout)
        if self.corpus.ntoken > model.config.ntoken:
            raise PeerUnavailable(f"the corpus has {self.corpus.ntoken} word types but the servers' model only "
                                  f"{model.config.ntoken} rows; start the servers with --data or a larger --ntoken")
        return LmTask(model, BatchStream(self.train, self.cfg.bptt), self.cfg, self.corpus.description, self.heldout,
                      self.metrics)
