"""The CTR trainer: the shared trainer role (``trainer/core/role.py``) training the model the servers
host (the built-in DLRM, or a user's) over its share of generated data, Criteo files, or a
schema's files for a user's model; files are checked before it joins."""
from __future__ import annotations

import logging

from typing import Optional

from ps.client.cache import HotRows
from ps.client.client import PsClient
from rpcps.data.source import Source, load_source
from rpcps.data.builders import criteo_source, schema_source
from rpcps.model import ModelError
from services.errors import ConfigError
from services.names import parse_name
from services.role import RoleContext
from trainer.core.hot_rows import row_cache
from trainer.core.role import ServedTrainer
from trainer.ctr import builtin
from trainer.ctr.config import CtrTrainerConfig
from trainer.ctr.custom import SchemaModel, hosted_module
from trainer.ctr.task import CtrTask

log = logging.getLogger(__name__)


class CtrTrainer(ServedTrainer):
    role = "ctr"

    def __init__(self, cfg: CtrTrainerConfig, ctx: RoleContext) -> None:
        super().__init__(cfg, ctx)
        self.cfg: CtrTrainerConfig = cfg

    def evaluates(self) -> bool:
        return self.cfg.eval_samples > 0

    def prefetch(self) -> int:
        return self.cfg.prefetch

    def place_backward(self, client: PsClient) -> None:
        if self.cfg.backward == "distributed":
            return
        try:
            client.backward_here()
        except ValueError as exc:
            if self.cfg.backward == "local":
                raise ConfigError(f"--backward local: {exc}") from None
            log.info("the steps' backward runs by distributed autograd: %s", exc)

    def cache(self) -> Optional[HotRows]:
        return row_cache(self.cfg.cache_rows, self.cfg.cache_staleness, self.cfg.cache_share)

    def task(self, client: PsClient) -> CtrTask:
        cfg, hosted = self.cfg, client.model
        share = parse_name(cfg.name).index % cfg.num_trainers
        model = SchemaModel(client, hosted_module(hosted))
        if hosted["model"] == builtin.MODEL:
            if cfg.schema_file is not None:
                raise ConfigError(f"--schema {cfg.schema_file}: the servers host the built-in DLRM, which reads "
                                  f"Criteo's format; start them with --model and --schema")
            data = hosted["criteo"]
            try:
                source = criteo_source(cfg.data, data["cardinalities"], data["hashed"], cfg.batch_size,
                                       cfg.held_in_data, share, cfg.num_trainers, cfg.hot, cfg.data_seed, cfg.eval_data,
                                       cfg.followed())
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            return self._task(model, source, share)
        # A user's model over a schema: this trainer reads the schema's files, or the user's source.
        schema = cfg.loaded_schema()
        if schema is None or (cfg.data is None and cfg.source is None):
            raise ConfigError(f"the servers host {hosted['model']}, which reads records by a schema: give --schema, "
                              f"and --data or --source")
        if schema.model_dump(mode="json") != hosted["schema"]:
            raise ConfigError(f"--schema {cfg.schema_file} is not the schema the servers host {hosted['model']} with: "
                              f"start every role with the same file")
        if cfg.source is not None:
            try:
                return self._task(model, load_source(cfg.source, schema, share, cfg.num_trainers, cfg.batch_size),
                                  share)
            except ModelError as exc:
                raise ConfigError(str(exc)) from None
        try:
            source = schema_source(schema, cfg.data, cfg.batch_size, cfg.held_in_data, share, cfg.num_trainers,
                                   cfg.eval_data, cfg.followed())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return self._task(model, source, share)

    def _task(self, model: SchemaModel, source: Source, share: int) -> CtrTask:
        cfg = self.cfg
        log.info("data: %s; share %d of %d, %d samples a step", source.description, share, cfg.num_trainers,
                 cfg.batch_size)
        return CtrTask(model, source, name=cfg.name, num_trainers=cfg.num_trainers, eval_samples=cfg.eval_samples,
                       eval_batch_size=cfg.eval_batch_size, metrics=self.metrics, board=self.board)

