"""The parameter-server role: build this shard of the model a workload declares (its ``ModelSpec``),
join the group, serve until told to stop."""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Optional

from ps.leader import layout
from ps.spec.config import PsConfig, ps_names
from ps.spec.consistency import Consistency
from ps.server.counts import applied_counts
from ps.server.delta import apply_delta
from ps.leader.leading import Leading
from ps.server.participant import ServerPart, hand_over, handover_fits, own_file, shard_files
from ps.server.relayout import ShardMoves
from ps.server.scaling import Scaling
from ps.server.service import ParameterServer
from ps.server.status import shard_status
from ps.spec.model import ModelSpec
from ps.spec.sharding import Slots
from services.checkpoint.coordinator import CLUSTER_CHECKPOINT_KEY, Coordinator, follow_leader, standing_now
from services.checkpoint.handover import LEADER_LIFE, Handover, Standing
from services.checkpoint.parts import restore_newest
from services.checkpoint.periodic import take_final
from services.checkpoint.store import CheckpointInfo
from services.errors import CheckpointError, NotReady
from services.lifecycle import RoleState
from services.names import leader_of
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
        self.leading: Optional[Leading] = None           # ps0's duties
        self._stop = threading.Event()
        self._stopped = False                            # run() ended on request, not by a failure
        self._standing: Optional[Standing] = None        # where the leader last said the cluster stands
        self._handover = Handover(cfg.checkpoint_dir, cfg.name)
        self._slots: Optional[Slots] = None              # a server other than the leader: the leader's layout
        self._shown_epoch = 0                            # the layout epoch /status shows
        self.scaling = Scaling(cfg.name, leader_of(cfg.name), lambda: self.leading and self.leading.mover,
                               self.request_stop, lambda: self.endpoint.joined)

    def checkpoint(self) -> dict[str, Any]:
        if self.leading is None or self.leading.coordinator is None:
            result = self._ask_coordinator(Coordinator.take)
        else:
            result = self.leading.coordinator.take()
        self.board.update(last_checkpoint={k: result[k] for k in ("id", "step", "path")})
        return result

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.store.list()]

    def request_stop(self) -> None:
        self._stop.set()

    def counts(self) -> dict[str, Any]:
        """``GET /counts``: the updates in this server's rows, by slot (``--count-updates``)."""
        if self.server is None or not self.endpoint.joined:
            raise NotReady(f"{self.cfg.name} has not joined the group")
        return applied_counts(self.server)

    def run(self) -> None:
        self.spec = self._model()
        # Each operation is timed as a method of its own.
        self.metrics.init_ps([m for m in remote_methods(ParameterServer) if m != "op"] + list(self.spec.ops))
        # Build before joining: once trainers can see this server, it must be able to answer.
        resumed, self.server = self._build()
        info = self.server.info()
        shard, slots = info.shard, self.server.layout.slots
        # The model's own words, short: a derived model's tables and shapes are listed already.
        said = {k: v for k, v in info.model.items() if not isinstance(v, (dict, list))}
        log.info("shard %d of %d (layout %d of %d slots): rows %s, dense %s, model %s", shard, slots.num_shards,
                 slots.epoch, slots.count, info.tables, list(info.dense), said)
        self.board.update(model=info.model, consistency=info.consistency)     # the shard: ``_show_work``
        if self.membership.is_leader:
            self.leading = Leading(self.cfg, self.ctx, self.server, self.spec, self.client_role)
            self.leading.start_clock(resumed)
        self.checkpoints.add(ServerPart(self.cfg.name, self.server, self._describe))
        serve(self.server)
        serve(ShardMoves(self.server, self.request_stop, self._show_work))    # its side of a change of layout
        self.membership.add_listener(self.server.contexts.forget)
        if self.leading is not None:
            self.membership.on_join(self.leading.count_on)
        reply = self._join("joining the RPC group", note={"steps": self.server.optimizer.steps})
        if self.leading is not None:
            self.leading.lead(resumed, self.checkpoint)
        else:
            self.server.optimizer.advance_to(int(reply.get("steps", 0)))
            self._handover.remove()     # restored from, or not matching: used once either way
            read_standing = self.endpoint.reader(CLUSTER_CHECKPOINT_KEY)
        self.metrics.up.set(1)
        self._show_work()   # before anyone reads it
        self.board.set_state(RoleState.RUNNING, "serving")
        while not self._stop.wait(1.0):
            self._heartbeat()
            if not self.membership.is_leader:
                now = standing_now(read_standing)
                if now is not None and self._standing is not None and now.leader == self._standing.leader:
                    self._standing = now      # another leader's word is no news of the one this server serves
            if self.leading is not None:
                self.leading.tick()
            self._show_work()
        self._stopped = True

    def _show_work(self) -> None:
        server = self.server
        if self._shown_epoch != server.layout.epoch:     # a change of layout rebuilt the shard
            self._shown_epoch = server.layout.epoch
            self.board.update(**shard_status(server.layout, server.shard, self.metrics))
        hashed = server.hashed.describe() or None
        self.board.update(steps=server.optimizer.steps, refused=server.refusals.count,
                          superseded=server.refusals.superseded, stale=server.refusals.stale,
                          applied=server.optimizer.marks.status(),
                          work=server.work.describe(), hashed=hashed)
        if hashed:
            self.metrics.hashed(hashed, server.hashed.stale_rows)

    def _build(self) -> tuple[Optional[CheckpointInfo], ParameterServer]:
        """This shard: from the checkpoint the cluster stands on (ps0's choice), from this server's
        own handover when a new leader succeeds the one it served, or fresh; under the layout the
        leader chose (``ps/leader/layout.py``), which the leader chooses here, from the checkpoint
        it restores."""
        resume, resume_from = self.cfg.resume, self.cfg.resume_from
        if self.endpoint.leader != self.cfg.name:
            self.board.set_state(RoleState.JOINING, f"asking {self.endpoint.leader} which checkpoint to restore")
            self._standing = follow_leader(self.endpoint.connect(), self.cfg.join_timeout)
            self._slots = layout.published(self.endpoint.connect(), self.cfg.join_timeout)
            resume_from = self._standing.checkpoint
            resume = resume_from is not None
            log.info("%s stands on %s", self.endpoint.leader, resume_from or "no checkpoint (a fresh start)")
            kept = self._from_handover()
            if kept is not None:
                return kept
        choice = layout.choice(self.spec, ps_names(self.cfg.num_ps), self._slots, self.cfg.checkpoint_dir)
        if not choice.holds(self.cfg.name):     # joins a running job: holds nothing until slots move to it
            resume, resume_from = False, None
        try:
            resumed, server = restore_newest(
                self.store, resume, resume_from,
                lambda info: shard_files(info, self.spec, choice.of(info), self.cfg.name),
                lambda states: self._server(choice.last, states), merge=apply_delta)
        except CheckpointError as exc:
            if self.endpoint.leader == self.cfg.name or resume_from is None:
                raise
            raise CheckpointError(f"{self.endpoint.leader} resumed the cluster from {resume_from}, which this server "
                                  f"cannot restore from {self.store.root}: {exc}") from None
        if resumed is not None:
            self.board.update(resumed_from={"id": resumed.id, "step": resumed.step, "path": str(resumed.path)})
            if own_file(resumed, server.layout.slots) and not server.hashed.cut:
                server.params.touched.since = resumed.step     # its own shard, as saved: deltas may follow
        return resumed, server

    def _server(self, slots: Slots, states: Optional[list[dict[str, Any]]]) -> ParameterServer:
        return ParameterServer(self.cfg.name, slots.position(self.cfg.name), slots, self.spec, self.metrics,
                               restore=states, consistency=Consistency.parse(self.cfg.consistency),
                               max_ids=self.cfg.max_ids_per_request)

    def _from_handover(self) -> Optional[tuple[Optional[CheckpointInfo], ParameterServer]]:
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
        if not handover_fits(state, self.spec, self._slots, self.cfg.name):
            log.warning("discarding the handover in %s: it holds another shard, layout or model", self._handover.folder)
            return None
        since = info.step if info is not None else 0
        server = self._server(self._slots, [state])
        log.info("kept this shard as handed over when it left the group: step %d, %d updates since %s",
                 meta["steps"], meta["steps"] - since, self._standing.checkpoint or "the start")
        self.board.update(resumed_from={"id": self._standing.checkpoint, "step": meta["steps"], "handover": True,
                                        "updates_kept": meta["steps"] - since})
        return info, server

    def _describe(self) -> dict[str, Any]:
        """What this server's part adds to a checkpoint's manifest: the mode (and ps0's clocks)."""
        return {"consistency": str(self.server.consistency), **(self.leading.describe() if self.leading else {})}

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        if self.leading is not None:
            self.leading.stop_checkpoints()
        if self.ctx.leader_lost.is_set() and self.server is not None and self._standing is not None:
            hand_over(ServerPart(self.cfg.name, self.server), self._handover, self._standing)
        else:
            self._final_checkpoint()
        self._leave()
        if self.leading is not None:
            self.leading.close(self._stopped)
        if self.server is not None:
            withdraw(self.server)
            withdraw(local(ShardMoves))

    def _final_checkpoint(self) -> None:
        """On the way out, keep what was trained since the last checkpoint, within a bound.

        Whichever server stops first takes it, while every shard is still up: `docker compose down`
        and `rpcps up` stop ps1 before ps0, and ps0 alone could not checkpoint without it."""
        if self.server is None or self.server.optimizer.steps == 0 or not self.endpoint.joined or self.server.empty:
            return
        steps = self.server.optimizer.steps
        if self.leading is not None and self.leading.coordinator is not None:
            take = functools.partial(self.leading.coordinator.take_unless_saved, steps)
        else:
            take = functools.partial(self._ask_coordinator, Coordinator.take_unless_saved, steps,
                                     timeout=FINAL_CHECKPOINT_SECONDS)
        take_final(take, FINAL_CHECKPOINT_SECONDS)
