"""The parameter-server role: build this shard of the model a workload declares (its ``ModelSpec``),
join the group, serve until told to stop."""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Optional

from ps.clock import StepClock, StepClockService, applier
from ps.config import PsConfig, ps_names
from ps.consistency import Consistency
from ps.participant import ServerPart, shard_files
from ps.service import ParameterServer
from ps.stub import apply_sync_step
from ps.spec import ModelSpec
from services.checkpoint.coordinator import CheckpointPlan, Coordinator, announce, follow_leader
from services.checkpoint.parts import restore_newest
from services.checkpoint.periodic import Periodic, take_final
from services.checkpoint.store import CheckpointInfo
from services.errors import CheckpointError
from services.lifecycle import RoleState
from services.names import parse_name
from services.remote import local, remote_methods, serve, withdraw
from services.role import RoleBase, RoleContext, WithoutEpisodes

log = logging.getLogger(__name__)

FINAL_CHECKPOINT_SECONDS = 5.0  # inside the 10 s a stop may take


class PsRole(RoleBase, WithoutEpisodes):
    role = "ps"
    no_episodes = "parameter servers have no episodes; {} them on the trainers"

    def __init__(self, cfg: PsConfig, ctx: RoleContext, model: Callable[[], ModelSpec]) -> None:
        """``model``: what this server hosts, described by its workload when the role runs (it may
        read a corpus to size a table)."""
        super().__init__(ctx)
        self.cfg, self._model = cfg, model
        self.spec: Optional[ModelSpec] = None
        self.server: Optional[ParameterServer] = None
        self.coordinator: Optional[Coordinator] = None
        self.clock: Optional[StepClock] = None           # ps0, in sync and ssp modes
        self._periodic: Optional[Periodic] = None
        self._stop = threading.Event()

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
        self.spec = self._model()
        # Each operation is timed as a method of its own.
        self.metrics.init_ps([m for m in remote_methods(ParameterServer) if m != "op"] + list(self.spec.ops))
        shard = parse_name(self.cfg.name).index
        # Build before joining: once trainers can see this server, it must be able to answer.
        resumed, self.server = self._build(shard)
        info = self.server.info()
        log.info("shard %d of %d: rows %s, dense %s, model %s", shard, self.cfg.num_ps, info.tables,
                 list(info.dense), info.model)
        self.board.update(shard=shard, num_shards=self.cfg.num_ps, rows=sum(info.tables.values()),
                          tables=info.tables, dense=list(info.dense), model=info.model, consistency=info.consistency)
        if self.membership.is_leader:
            self._start_clock(resumed)
        self.checkpoints.add(ServerPart(self.cfg.name, self.server, self._describe))
        serve(self.server)
        self.membership.add_listener(self.server.forget)
        self._join("joining the RPC group")
        if self.membership.is_leader:
            self._lead(resumed)
        self.metrics.up.set(1)
        self.board.set_state(RoleState.RUNNING, "serving")
        while not self._stop.wait(1.0):
            self._heartbeat()
            if self.clock is not None:
                self.clock.tick()
                self.board.update(clock=self.clock.describe())
            self.board.update(steps=self.server.optimizer.steps, refused=self.server.refused)

    def _build(self, shard: int) -> tuple[Optional[CheckpointInfo], ParameterServer]:
        """This shard, from the checkpoint the cluster stands on (ps0's choice) or fresh."""
        resume, resume_from = self.cfg.resume, self.cfg.resume_from
        if self.endpoint.leader != self.cfg.name:
            self.board.set_state(RoleState.JOINING, f"asking {self.endpoint.leader} which checkpoint to restore")
            resume_from = follow_leader(self.endpoint.connect(), self.cfg.join_timeout)
            resume = resume_from is not None
            log.info("%s stands on %s", self.endpoint.leader, resume_from or "no checkpoint (a fresh start)")
        try:
            resumed, server = restore_newest(
                self.store, resume, resume_from, lambda info: shard_files(info, self.spec, shard, self.cfg.num_ps),
                lambda states: ParameterServer(self.cfg.name, shard, self.cfg.num_ps, self.spec, self.metrics,
                                               restore=states, consistency=Consistency.parse(self.cfg.consistency),
                                               max_ids=self.cfg.max_ids_per_request))
        except CheckpointError as exc:
            if self.endpoint.leader == self.cfg.name or resume_from is None:
                raise
            raise CheckpointError(f"{self.endpoint.leader} resumed the cluster from {resume_from}, which this server "
                                  f"cannot restore from {self.store.root}: {exc}") from None
        if resumed is not None:
            self.board.update(resumed_from={"id": resumed.id, "step": resumed.step, "path": str(resumed.path)})
        return resumed, server

    def _start_clock(self, resumed: Optional[CheckpointInfo]) -> None:
        """ps0: keep the trainers' step clock (sync, ssp), continuing the checkpoint's."""
        consistency = self.server.consistency
        saved = resumed.meta.get("consistency", "async") if resumed is not None else None
        if saved is not None and saved != str(consistency):
            log.warning("consistency changed across the restart: %s was taken with %s, this job runs %s",
                        resumed.id, saved, consistency)
        if not consistency.clocked:
            return
        servers = ps_names(self.cfg.num_ps)
        clocks = resumed.meta.get("clocks", {}) if resumed is not None and saved == str(consistency) else {}
        self.clock = StepClock(consistency, apply=functools.partial(apply_sync_step, servers, self.cfg.rpc_timeout),
                               run=applier(), metrics=self.metrics, step=self.server.optimizer.steps,
                               saved=dict(clocks))
        serve(StepClockService(self.clock))
        self.membership.add_listener(self.clock.drop)
        self.board.update(clock=self.clock.describe())

    def _describe(self) -> dict[str, Any]:
        """What ps0's part adds to a checkpoint's manifest: the mode and its step clock."""
        out: dict[str, Any] = {"consistency": str(self.server.consistency)}
        if self.clock is not None:
            out["clocks"] = self.clock.clocks()
        return out

    def _lead(self, resumed: Optional[CheckpointInfo]) -> None:
        """ps0: coordinate checkpoints, and announce the one the cluster stands on."""
        publish = functools.partial(announce, self.endpoint.store)
        publish(resumed)
        plan = CheckpointPlan(holders=tuple(ps_names(self.cfg.num_ps)), paused_role="trainer",
                              meta={"model": self.spec.meta, "num_ps": self.cfg.num_ps})
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
        if self.clock is not None:
            withdraw(local(StepClockService))

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
