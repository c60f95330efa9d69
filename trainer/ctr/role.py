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
from trainer.ctr.source import FileSource, GeneratedSource, criteo_files
from trainer.ctr.synthetic import SyntheticCtr
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
            paths = data_files(cfg.data)
            source = FileSource(f"Criteo files {', '.join(map(str, paths))}", criteo_files(paths, sizes),
                                cfg.batch_size, cfg.eval_samples, share,
                                cfg.num_trainers)
        return self._task(model, source, share)

    def _schema_task(self, client: PsClient, share: int) -> CtrTask:
        """The servers host a user's model over a schema: this trainer reads the schema's files."""
        from rpcps.schema import Schema
        from trainer.ctr.custom import SchemaModel, build_model
        from trainer.ctr.tabular import Encoder, SchemaStream, measure
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
        paths = data_files(cfg.data)
        stats = measure(schema, paths)
        for column, (mean, std) in stats.items():
            log.info("column %s standardized by the mean %.6g and std %.6g of the data's first lines", column, mean, std)
        encoder = Encoder(schema, stats)
        source = FileSource(f"{schema.format.upper()} files {', '.join(map(str, paths))}",
                            lambda s, n, start, stop: SchemaStream(encoder, paths, s, n, start, stop),
                            cfg.batch_size, cfg.eval_samples, share, cfg.num_trainers)
        return self._task(model, source, share)

    def _task(self, model: CtrModel, source: Source, share: int) -> CtrTask:
        cfg = self.cfg
        log.info("data: %s; share %d of %d, %d samples a step", source.description, share, cfg.num_trainers,
                 cfg.batch_size)
        return CtrTask(model, source, name=cfg.name, num_trainers=cfg.num_trainers, eval_samples=cfg.eval_samples,
                       eval_batch_size=cfg.eval_batch_size, metrics=self.metrics, board=self.board)

