"""The parameter-server role: build this shard, join the group, serve until told to stop."""
from __future__ import annotations

import logging
import threading
from typing import Any

from ps import service
from ps.service import ParameterServer
from services.config import ModelConfig, PsConfig
from services.control import EpisodeStart
from services.errors import NotSupported
from services.lifecycle import RoleState, StatusBoard
from services.membership import Membership, current_members
from services.metrics import Metrics
from services.names import parse_name
from services.rpc import RpcEndpoint
from trainer.data import vocab_size

log = logging.getLogger(__name__)


def model_config(cfg: PsConfig) -> ModelConfig:
    ntoken = cfg.ntoken if cfg.ntoken is not None else vocab_size(cfg.data)
    return ModelConfig(ntoken=ntoken, emsize=cfg.emsize, nhid=cfg.nhid, nlayers=cfg.nlayers,
                       init_range=cfg.init_range, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr)


class PsRole:
    role = "ps"

    def __init__(self, cfg: PsConfig, metrics: Metrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.board = StatusBoard(self.role, cfg.name)
        self.endpoint = RpcEndpoint(cfg.name, cfg.master_addr, cfg.master_port,
                                    rpc_timeout=cfg.rpc_timeout, join_timeout=cfg.join_timeout,
                                    transport=cfg.rpc_transport)
        self.membership = Membership(cfg.name, probe_interval=cfg.probe_interval,
                                     probe_failures=cfg.probe_failures,
                                     on_evicted=metrics.members_evicted.inc)
        self.server: ParameterServer | None = None
        self._stop = threading.Event()
        metrics.init_ps()

    # --- Controllable ------------------------------------------------------------------------------
    def healthy(self) -> tuple[bool, str]:
        return self.board.healthy()

    def ready(self) -> tuple[bool, str]:
        return self.board.ready()

    def status(self) -> dict[str, Any]:
        return self.board.snapshot()

    def start_episode(self, request: EpisodeStart) -> dict[str, Any]:
        raise NotSupported("parameter servers have no episodes; start them on the trainers")

    def stop_episode(self) -> dict[str, Any]:
        raise NotSupported("parameter servers have no episodes; stop them on the trainers")

    def checkpoint(self) -> dict[str, Any]:
        raise NotSupported("cluster checkpoints are not implemented yet")

    def list_checkpoints(self) -> list[dict[str, Any]]:
        raise NotSupported("cluster checkpoints are not implemented yet")

    # --- lifecycle -----------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        model = model_config(self.cfg)
        shard = parse_name(self.cfg.name).index
        # Build before joining: once trainers can see this server, it must be able to answer.
        self.server = ParameterServer(self.cfg.name, shard, self.cfg.num_ps, model, self.metrics)
        info = self.server.info()
        log.info("shard %d of %d: %d vocabulary rows, LSTM layers %s, model %s",
                 shard, self.cfg.num_ps, info.rows, list(info.layers), model.model_dump())
        service.HOSTED.set(self.server)
        self.board.update(shard=shard, num_shards=self.cfg.num_ps, rows=info.rows, layers=list(info.layers),
                          model=model.model_dump())
        self.board.set_state(RoleState.JOINING, "joining the RPC group")
        self.membership.add_listener(self.server.forget)
        self.membership.install()
        self.endpoint.join()
        if self.membership.is_leader:
            self.membership.start_leader(self.endpoint.store)
        self.metrics.up.set(1)
        self.board.set_state(RoleState.RUNNING, "serving")
        while not self._stop.wait(1.0):
            members = current_members()
            self.metrics.members.set(len(members))
            self.board.update(members=members)

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        self.membership.stop()
        self.endpoint.leave()
        self.membership.uninstall()
        service.HOSTED.set(None)
        if self.server is not None:
            self.server.close()
