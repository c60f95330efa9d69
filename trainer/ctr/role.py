"""The CTR trainer: the shared trainer role (``trainer/core/role.py``) over its share of generated
or Criteo data; Criteo files are checked before it joins."""
from __future__ import annotations

import logging

from ps.stub import PsClient
from services.errors import ConfigError
from services.names import parse_name
from services.role import RoleContext
from trainer.core.role import ServedTrainer
from trainer.ctr.config import CtrTrainerConfig, data_files
from trainer.ctr.model import DistributedDlrm
from trainer.ctr.source import FileSource, GeneratedSource
from trainer.ctr.synthetic import SyntheticCtr
from trainer.ctr.task import CtrTask

log = logging.getLogger(__name__)


class CtrTrainer(ServedTrainer):
    role = "ctr"

    def __init__(self, cfg: CtrTrainerConfig, ctx: RoleContext) -> None:
        super().__init__(cfg, ctx)
        self.cfg: CtrTrainerConfig = cfg

    def evaluates(self) -> bool:
        return self.cfg.eval_samples > 0

    def task(self, client: PsClient) -> CtrTask:
        cfg = self.cfg
        model = DistributedDlrm(client)
        share = parse_name(cfg.name).index % cfg.num_trainers
        cardinalities = model.config.cardinalities
        if cfg.data is None:
            try:
                generator = SyntheticCtr.fitting(cardinalities, cfg.data_seed)
            except ValueError as exc:
                raise ConfigError(f"the servers' {exc}: generated data cannot fill them; use --data") from None
            source = GeneratedSource(generator, cfg.batch_size, share, cfg.num_trainers, cfg.hot,
                                     hashed=model.config.hashed)
        else:
            # A hashed table takes a value's 64-bit hash itself: modulo 0.
            sizes = [0 if t in model.config.hashed else c for t, c in enumerate(cardinalities)]
            source = FileSource(data_files(cfg.data), sizes, cfg.batch_size, cfg.eval_samples, share,
                                cfg.num_trainers)
        log.info("data: %s; share %d of %d, %d samples a step", source.description, share, cfg.num_trainers,
                 cfg.batch_size)
        return CtrTask(model, source, name=cfg.name, num_trainers=cfg.num_trainers, eval_samples=cfg.eval_samples,
                       eval_batch_size=cfg.eval_batch_size, metrics=self.metrics, board=self.board)

