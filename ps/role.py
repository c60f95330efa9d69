"""The parameter-server role: build this shard, join the group, serve until told to stop."""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Optional

from ps.participant import ServerPart, shard_files
from ps.service import ParameterServer
from services.checkpoint.coordinator import CheckpointPlan, Coordinator, announce, follow_leader
from services.checkpoint.parts import restore_newest
from services.checkpoint.periodic import Periodic, take_final
from services.checkpoint.store import CheckpointInfo
from ps.config import ModelConfig, PsConfig, ps_names
from services.errors import CheckpointError
from services.lifecycle import RoleState
from services.names import parse_name
from services.remote import remote_methods, serve, withdraw
from services.role import RoleBase, RoleContext, WithoutEpisodes
from trainer.lm.data import vocab_size

log = logging.getLogger(__name__)

FINAL_CHECKPOINT_SECONDS = 5.0  # inside the 10 s a stop may take


def model_config(cfg: PsConfig) -> ModelConfig:
    ntoken = cfg.ntoken if cfg.ntoken is not None else vocab_size(cfg.data)
    return ModelConfig(ntoken=ntoken, emsize=cfg.emsize, nhid=cfg.nhid, nlayers=cfg.nlayers,
                       init_range=cfg.init_range, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr)


class PsRole(RoleBase, WithoutEpisodes):
    role = "ps"
    no_episodes = "parameter servers have no episodes; {} them on the trainers"

    def __init__(self, cfg: PsConfig, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self.server: Optional[ParameterServer] = None
        self.coordinator: Optional[Coordinator] = None
        self._periodic: Optional[Periodic] = None
        self._stop = threading.Event()
        self.metrics.init_ps(remote_methods(ParameterServer))

    def checkpoint(self) -> dict[str, Any]:
        if self.coordinator is None:
            result = self._ask_coordinator(Coordinator.take)
        else:
            result = self.coordinator.take()
        self.board.update(last_checkpoint={k: result[k] for k in ("id", "step", "path")})
        return result

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.store.list()]

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        model = model_config(self.cfg)
        shard = parse_name(self.cfg.name).index
        # Build before joining: once trainers can see this server, it must be able to answer.
        resumed, self.server = self._build(model, shard)
        info = self.server.info()
        log.info("shard %d of %d: %d vocabulary rows, LSTM layers %s, model %s",
                 shard, self.cfg.num_ps, info.rows, list(info.layers), model.model_dump())
        self.board.update(shard=shard, num_shards=self.cfg.num_ps, rows=info.rows, layers=list(info.layers),
                          model=model.model_dump())
        self.checkpoints.add(ServerPart(self.cfg.name, self.server))
        serve(self.server)
        self.membership.add_listener(self.server.forget)
        self._join("joining the RPC group")
        if self.membership.is_leader:
            self._lead(model, resumed)
        self.metrics.up.set(1)
        self.board.set_state(RoleState.RUNNING, "serving")
        while not self._stop.wait(1.0):
            self._heartbeat()
            self.board.update(steps=self.server.optimizer.steps)

    def _build(self, model: ModelConfig, shard: int) -> tuple[Optional[CheckpointInfo], ParameterServer]:
        """This shard, from the checkpoint the cluster stands on (ps0's choice) or fresh."""
        resume, resume_from = self.cfg.resume, self.cfg.resume_from
        if self.endpoint.leader != self.cfg.name:
            self.board.set_state(RoleState.JOINING, f"asking {self.endpoint.leader} which checkpoint to restore")
            resume_from = follow_leader(self.endpoint.connect(), self.cfg.join_timeout)
            resume = resume_from is not None
            log.info("%s stands on %s", self.endpoint.leader, resume_from or "no checkpoint (a fresh start)")
        try:
            resumed, server = restore_newest(
                self.store, resume, resume_from, lambda info: shard_files(info, model.model_dump(), shard, self.cfg.num_ps),
                lambda states: ParameterServer(self.cfg.name, shard, self.cfg.num_ps, model, self.metrics, restore=states))
        except CheckpointError as exc:
            if self.endpoint.leader == self.cfg.name or resume_from is None:
                raise
            raise CheckpointError(f"{self.endpoint.leader} resumed the cluster from {resume_from}, which this server "
                                  f"cannot restore from {self.store.root}: {exc}") from None
        if resumed is not None:
            self.board.update(resumed_from={"id": resumed.id, "step": resumed.step, "path": str(resumed.path)})
        return resumed, server

    def _lead(self, model: ModelConfig, resumed: Optional[CheckpointInfo]) -> None:
        """ps0: coordinate checkpoints, and announce the one the cluster stands on."""
        publish = functools.partial(announce, self.endpoint.store)
        publish(resumed)
        plan = CheckpointPlan(holders=tuple(ps_names(self.cfg.num_ps)), paused_role="trainer",
                              meta={"model": model.model_dump(), "num_ps": self.cfg.num_ps})
        self.coordinator = Coordinator(self.store, plan, self.cfg.keep_checkpoints, local=self.checkpoints,
                                       metrics=self.metrics, resumed=resumed, on_commit=publish)
        serve(self.coordinator)
        self._periodic = Periodic(self.checkpoint, lambda: self.server.optimizer.steps,
                                  self.cfg.checkpoint_every_steps, self.cfg.checkpoint_every_seconds).start()

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        if self._periodic is not None:
            self._periodic.stop()
        self._final_checkpoint()
        self._leave()
        for served in (self.server, self.coordinator):
            if served is not None:
                withdraw(served)

    def _final_checkpoint(self) -> None:
        """On the way out, keep what was trained since the last checkpoint, within a bound.

        Whichever server stops first takes it, while every shard is still up: `docker compose down`
        and `rpcps up` stop ps1 before ps0, and ps0 alone could not checkpoint without it."""
        if self.server is None or self.server.optimizer.steps == 0 or not self.endpoint.joined:
            return
        steps = self.server.optimizer.steps
        if self.coordinator is not None:
            take = functools.partial(self.coordinator.take_unless_saved, steps)
        else:
            take = functools.partial(self._ask_coordinator, Coordinator.take_unless_saved, steps,
                                     timeout=FINAL_CHECKPOINT_SECONDS)
        take_final(take, FINAL_CHECKPOINT_SECONDS)
