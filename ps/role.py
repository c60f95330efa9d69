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
from services.checkpoint.coordinator import (CLUSTER_CHECKPOINT_KEY, CheckpointPlan, Coordinator, announce,
                                             follow_leader, standing_now)
from services.checkpoint.handover import LEADER_LIFE, Handover, LeaderLife, Standing
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

    def __init__(self, cfg: PsConfig, ctx: RoleContext, model: Callable[[], ModelSpec], client_role: str) -> None:
        """``model``: what this server hosts, described by its workload when the role runs (it may
        read a corpus to size a table); ``client_role``: the role that trains against it."""
        super().__init__(ctx)
        self.cfg, self._model, self.client_role = cfg, model, client_role
        self.spec: Optional[ModelSpec] = None
        self.server: Optional[ParameterServer] = None
        self.coordinator: Optional[Coordinator] = None
        self.clock: Optional[StepClock] = None           # ps0, in sync and ssp modes
        self._periodic: Optional[Periodic] = None
        self._stop = threading.Event()
        self._stopped = False                            # run() ended on request, not by a failure
        self._life: Optional[LeaderLife] = None          # ps0: its life, for the servers' handovers
        self._standing: Optional[Standing] = None        # where the leader last said the cluster stands
        self._handover = Handover(cfg.checkpoint_dir, cfg.name)

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
        if self.membership.is_leader:
            self.membership.on_join(self._count_on)
        reply = self._join("joining the RPC group", note={"steps": self.server.optimizer.steps})
        if self.membership.is_leader:
            self._lead(resumed)
        else:
            self.server.optimizer.advance_to(int(reply.get("steps", 0)))
            self._handover.remove()     # restored from, or not matching: used once either way
            read_standing = self.endpoint.reader(CLUSTER_CHECKPOINT_KEY)
        self.metrics.up.set(1)
        self.board.update(steps=self.server.optimizer.steps, refused=self.server.refused)   # before anyone reads it
        self.board.set_state(RoleState.RUNNING, "serving")
        while not self._stop.wait(1.0):
            self._heartbeat()
            if not self.membership.is_leader:
                now = standing_now(read_standing)
                if now is not None and self._standing is not None and now.leader == self._standing.leader:
                    self._standing = now      # another leader's word is no news of the one this server serves
            if self.clock is not None:
                self.clock.tick()
                self.board.update(clock=self.clock.describe())
            self.board.update(steps=self.server.optimizer.steps, refused=self.server.refused)
        self._stopped = True

    def _build(self, shard: int) -> tuple[Optional[CheckpointInfo], ParameterServer]:
        """This shard: from the checkpoint the cluster stands on (ps0's choice), from this server's
        own handover when a new leader succeeds the one it served, or fresh."""
        resume, resume_from = self.cfg.resume, self.cfg.resume_from
        if self.endpoint.leader != self.cfg.name:
            self.board.set_state(RoleState.JOINING, f"asking {self.endpoint.leader} which checkpoint to restore")
            self._standing = follow_leader(self.endpoint.connect(), self.cfg.join_timeout)
            resume_from = self._standing.checkpoint
            resume = resume_from is not None
            log.info("%s stands on %s", self.endpoint.leader, resume_from or "no checkpoint (a fresh start)")
            kept = self._from_handover(shard)
            if kept is not None:
                return kept
        try:
            resumed, server = restore_newest(
                self.store, resume, resume_from, lambda info: shard_files(info, self.spec, shard, self.cfg.num_ps),
                functools.partial(self._server, shard))
        except CheckpointError as exc:
            if self.endpoint.leader == self.cfg.name or resume_from is None:
                raise
            raise CheckpointError(f"{self.endpoint.leader} resumed the cluster from {resume_from}, which this server "
                                  f"cannot restore from {self.store.root}: {exc}") from None
        if resumed is not None:
            self.board.update(resumed_from={"id": resumed.id, "step": resumed.step, "path": str(resumed.path)})
        return resumed, server

    def _server(self, shard: int, states: Optional[list[dict[str, Any]]]) -> ParameterServer:
        return ParameterServer(self.cfg.name, shard, self.cfg.num_ps, self.spec, self.metrics, restore=states,
                               consistency=Consistency.parse(self.cfg.consistency), max_ids=self.cfg.max_ids_per_request)

    def _from_handover(self, shard: int) -> Optional[tuple[Optional[CheckpointInfo], ParameterServer]]:
        """This server's shard as it handed it over when the leader was lost, if the new leader
        stands where that one stood."""
        if not self._handover.exists():
            return None
        try:
            info = self.store.resolve(self._standing.checkpoint, verify=False) if self._standing.checkpoint else None
        except CheckpointError:
            return None         # the checkpoint path says what is wrong with this folder
        kept = self._handover.take(self._standing, info.meta.get(LEADER_LIFE) if info is not None else None)
        if kept is None:
            return None
        state, meta = kept
        if (state.get("shard"), state.get("num_shards")) != (shard, self.cfg.num_ps) or any(
                state.get("model", {}).get(k) != self.spec.meta.get(k) for k in self.spec.compatible):
            log.warning("discarding the handover in %s: it holds another shard or model", self._handover.folder)
            return None
        since = info.step if info is not None else 0
        server = self._server(shard, [state])
        log.info("kept this shard as handed over when the leader was lost: step %d, %d updates since %s",
                 meta["steps"], meta["steps"] - since, self._standing.checkpoint or "the start")
        self.board.update(resumed_from={"id": self._standing.checkpoint, "step": meta["steps"], "handover": True,
                                        "updates_kept": meta["steps"] - since})
        return info, server

    def _count_on(self, name: str, note: dict) -> dict:
        """ps0, as a server joins: every server counts steps from the furthest one's count. Steps
        number the cluster's updates (sync mode needs them equal); a server that kept its shard
        across a lost leader has come further than the checkpoint ps0 restored, and one restarted
        alone from a checkpoint is behind."""
        steps = self.server.optimizer.advance_to(int(note.get("steps", 0)))
        if self.clock is not None:
            self.clock.advance_to(steps)
        return {"steps": steps}

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
        self._life = LeaderLife(self.cfg.checkpoint_dir)
        succeeds = self._life.begin()
        if succeeds is not None:
            log.warning("the previous leader (life %s) did not stop cleanly: servers keep what they handed over", succeeds)

        def publish(info: Optional[CheckpointInfo]) -> None:
            announce(self.endpoint.store, Standing(info.id if info is not None else None, self._life.life, succeeds))
        publish(resumed)
        plan = CheckpointPlan(holders=tuple(ps_names(self.cfg.num_ps)), paused_role=self.client_role,
                              meta={"model": self.spec.meta, "num_ps": self.cfg.num_ps, LEADER_LIFE: self._life.life})
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
        if self.ctx.leader_lost.is_set():
            self._hand_over()
        else:
            self._final_checkpoint()
        self._leave()
        if self._life is not None and self._stopped:
            self._life.release()
        for served in (self.server, self.coordinator):
            if served is not None:
                withdraw(served)
        if self.clock is not None:
            withdraw(local(StepClockService))

    def _hand_over(self) -> None:
        """The leader is gone: keep this shard for this server's next life (``handover.py``)."""
        if self.server is None or self._standing is None:
            return
        part = ServerPart(self.cfg.name, self.server)
        state = part.state_dict()
        try:
            part.check(state)
        except CheckpointError as exc:
            log.error("no handover: %s", exc)
            return
        self._handover.write(state, self._standing, int(state["steps"]))
        log.info("handed over this shard at step %d (the cluster stood on %s)", state["steps"],
                 self._standing.checkpoint or "no checkpoint")

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
