"""The CTR trainer: the shared trainer role (``trainer/core/role.py``) over its share of generated
data, Criteo files, or a schema's files for a user's model; files are checked before it joins."""
from __future__ import annotations

import logging

from ps.client.stub import PsClient
from services.errors import ConfigError
from services.names import parse_name
from services.role import RoleContext
from trainer.core.role import ServedTrainer
from trainer.ctr.config import CtrTrainerConfig
from trainer.ctr.model import DistributedDlrm
from trainer.ctr.source import criteo_source, schema_source
from trainer.ctr.task import CtrModel, CtrTask, Source

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
        share = parse_name(cfg.name).index % cfg.num_trainers
        if "schema" in client.model:
            return self._schema_task(client, share)
        if cfg.schema_file is not None:
            raise ConfigError(f"--schema {cfg.schema_file}: the servers host the built-in DLRM, which reads Criteo's "
                              f"format; start them with --model and --schema")
        model = DistributedDlrm(client)
        source = criteo_source(cfg.data, model.config.cardinalities, model.config.hashed, cfg.batch_size,
                               cfg.eval_samples, share, cfg.num_trainers, cfg.hot, cfg.data_seed)
        return self._task(model, source, share)

    def _schema_task(self, client: PsClient, share: int) -> CtrTask:
        """The servers host a user's model over a schema: this trainer reads the schema's files."""
        from rpcps.schema import Schema
        from trainer.ctr.custom import SchemaModel, build_model
        cfg, hosted = self.cfg, client.model
        schema = cfg.loaded_schema()
        if schema is None or cfg.data is None:
            raise ConfigError(f"the servers host {hosted['model']}, which reads files by a schema: give --data and "
                              f"--schema")
        if schema.model_dump(mode="json") != hosted["schema"]:
            raise ConfigError(f"--schema {cfg.schema_file} is not the schema the servers host {hosted['model']} with: "
                              f"start every role with the same file")
        model = SchemaModel(client, build_model(hosted["model"], Schema.model_validate(hosted["schema"]),
                                                int(hosted["seed"])))
        source = schema_source(schema, cfg.data, cfg.batch_size, cfg.eval_samples, share, cfg.num_trainers)
        return self._task(model, source, share)

    def _task(self, model: CtrModel, source: Source, share: int) -> CtrTask:
        cfg = self.cfg
        log.info("data: %s; share %d of %d, %d samples a step", source.description, share, cfg.num_trainers,
                 cfg.batch_size)
        return CtrTask(model, source, name=cfg.name, num_trainers=cfg.num_trainers, eval_samples=cfg.eval_samples,
                       eval_batch_size=cfg.eval_batch_size, metrics=self.metrics, board=self.board)

