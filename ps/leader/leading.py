"""What the leader (ps0) does beyond serving its shard: it owns the job's layout
(``ps/leader/layout.py``), keeps the trainers' step clock (sync, ssp), counts every server's steps
on from the furthest one's, coordinates checkpoints and takes
them periodically, and announces the checkpoint the cluster stands on, under its own life (so a
successor knows whether it left cleanly)."""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

from ps.leader import layout
from ps.leader.clock import StepClock, StepClockService, applier
from ps.leader.moves import Mover
from ps.spec.config import PsConfig
from ps.server.service import ParameterServer
from ps.spec.model import ModelSpec
from ps.spec.sharding import Slots
from ps.leader.sync_step import apply_sync_step
from services.checkpoint.coordinator import CheckpointPlan, Coordinator, announce
from services.checkpoint.handover import LEADER_LIFE, LeaderLife, Standing
from services.checkpoint.periodic import Periodic
from services.checkpoint.store import CheckpointInfo
from services.remote import local, serve, withdraw
from services.role import RoleContext

log = logging.getLogger("ps.server.role")


class Leading:
    def __init__(self, cfg: PsConfig, ctx: RoleContext, server: ParameterServer, spec: ModelSpec,
                 client_role: str) -> None:
        self.cfg, self.ctx, self.server, self.spec, self.client_role = cfg, ctx, server, spec, client_role
        self.slots = server.layout.slots     # the job's layout: chosen with the shard the leader built
        self.clock: Optional[StepClock] = None
        self.coordinator: Optional[Coordinator] = None
        self._periodic: Optional[Periodic] = None
        self._life: Optional[LeaderLife] = None
        self.mover: Optional[Mover] = None               # changes of layout, once it leads

    def start_clock(self, resumed: Optional[CheckpointInfo]) -> None:
        """Keep the trainers' step clock (sync, ssp), continuing the checkpoint's."""
        consistency = self.server.consistency
        saved = resumed.meta.get("consistency", "async") if resumed is not None else None
        if saved is not None and saved != str(consistency):
            log.warning("consistency changed across the restart: %s was taken with %s, this job runs %s",
                        resumed.id, saved, consistency)
        if not consistency.clocked:
            return
        clocks = resumed.meta.get("clocks", {}) if resumed is not None and saved == str(consistency) else {}
        self.clock = StepClock(consistency, apply=functools.partial(apply_sync_step, lambda: self.slots.servers,
                                                                      self.cfg.rpc_timeout),
                               run=applier(), metrics=self.ctx.metrics, step=self.server.optimizer.steps,
                               saved=dict(clocks))
        serve(StepClockService(self.clock))
        self.ctx.membership.add_listener(self.clock.drop)
        self.ctx.board.update(clock=self.clock.describe())

    def describe(self) -> dict[str, Any]:
        """What ps0 adds to a checkpoint's manifest: its step clock's clocks."""
        return {"clocks": self.clock.clocks()} if self.clock is not None else {}

    def count_on(self, name: str, note: dict) -> dict:
        """As a server joins: every server counts steps from the furthest one's count. Steps
        number the cluster's updates (sync mode needs them equal); a server that kept its shard
        across a lost leader has come further than the checkpoint ps0 restored, and one restarted
        alone from a checkpoint is behind."""
        steps = self.server.optimizer.advance_to(int(note.get("steps", 0)))
        if self.clock is not None:
            self.clock.advance_to(steps)
        return {"steps": steps}

    def lead(self, resumed: Optional[CheckpointInfo], take: Callable[[], Any]) -> None:
        """Coordinate checkpoints (``take`` one periodically), and announce the one the cluster stands on."""
        self._life = LeaderLife(self.cfg.checkpoint_dir)
        succeeds = self._life.begin()
        if succeeds is not None:
            log.warning("the previous leader (life %s) did not stop cleanly: servers keep what they handed over", succeeds)

        def publish(info: Optional[CheckpointInfo]) -> None:
            announce(self.ctx.endpoint.store, Standing(info.id if info is not None else None, self._life.life, succeeds))
        if resumed is None:
            layout.forget(self.cfg.checkpoint_dir)
        layout.publish(self.ctx.endpoint.store, self.slots)      # before the standing the other servers wait for
        publish(resumed)
        plan = CheckpointPlan(holders=self.slots.servers, paused_role=self.client_role,
                              meta={"model": self.spec.meta, "num_ps": self.slots.num_shards,
                                    "layout": self.slots.to_dict(), LEADER_LIFE: self._life.life})
        self.coordinator = Coordinator(self.ctx.store, plan, self.cfg.keep_checkpoints, local=self.ctx.checkpoints,
                                       metrics=self.ctx.metrics, resumed=resumed, on_commit=publish,
                                       full_every=self.cfg.full_checkpoint_every)
        serve(self.coordinator)
        self.mover = Mover(lambda: self.slots, self.adopt, self.coordinator.paused, self.ctx.membership.evict,
                           ended=self._changed)
        serve(self.mover)
        self._periodic = Periodic(take, lambda: self.server.optimizer.steps,
                                  self.cfg.checkpoint_every_steps, self.cfg.checkpoint_every_seconds).start()

    def adopt(self, slots: Slots) -> None:
        """The job's layout from now on (a change of layout's last act, the trainers held):
        published for servers that start later, kept beside the checkpoints for a leader started
        again, and recorded in every checkpoint after."""
        self.slots = slots
        layout.publish(self.ctx.endpoint.store, slots)
        layout.record(self.cfg.checkpoint_dir, slots)
        plan = self.coordinator.plan
        self.coordinator.plan = dataclasses.replace(plan, holders=slots.servers, meta={
            **plan.meta, "num_ps": slots.num_shards, "layout": slots.to_dict()})
        self.ctx.board.update(layout=slots.describe())

    def _changed(self, last: dict[str, Any]) -> None:
        self.ctx.metrics.layout_changes.labels(**self.ctx.metrics.labels, result=last["state"]).inc()
        if last["state"] == "done":
            self.ctx.metrics.layout_change_pause.set(last["pause_seconds"])
            self.ctx.metrics.layout_change_seconds.set(last["seconds"])
            self.ctx.metrics.layout_change_bytes.set(last.get("ahead_bytes", 0) + last["bytes"])
        self.ctx.board.update(change=last)

    def tick(self) -> None:
        if self.mover is not None:
            self.mover.tick()
            self.ctx.board.update(wanted=self.mover.wanted, change=self.mover.progress())
        if self.clock is not None:
            self.clock.tick()
            self.ctx.board.update(clock=self.clock.describe())

    def stop_checkpoints(self) -> None:
        if self._periodic is not None:
            self._periodic.stop()

    def close(self, stopped: bool) -> None:
        """``stopped``: on request; only then is the life released (anything else left the cluster unclean)."""
        if self._life is not None and stopped:
            self._life.release()
        if self.coordinator is not None:
            withdraw(self.coordinator)
        if self.mover is not None:
            withdraw(self.mover)
        if self.clock is not None:
            withdraw(local(StepClockService))
