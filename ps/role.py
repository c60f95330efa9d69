"""The parameter-server role: build this shard, join the group, serve until told to stop."""
from __future__ import annotations

import functools
import logging
import shutil
import threading
from typing import Any

from ps import service
from ps.service import ParameterServer
from services import checkpointing
from services.checkpoint import CheckpointStore, FileEntry
from services.config import ModelConfig, PsConfig
from services.control import BoardBacked, EpisodeStart
from services.errors import CheckpointError, NotReady, NotSupported
from services.lifecycle import RoleState, StatusBoard
from services.membership import Membership, current_members
from services.metrics import Metrics
from services.names import parse_name
from services.rpc import RpcEndpoint
from trainer.data import vocab_size

log = logging.getLogger(__name__)

FINAL_CHECKPOINT_SECONDS = 5.0  # inside the 10 s a stop may take


def model_config(cfg: PsConfig) -> ModelConfig:
    ntoken = cfg.ntoken if cfg.ntoken is not None else vocab_size(cfg.data)
    return ModelConfig(ntoken=ntoken, emsize=cfg.emsize, nhid=cfg.nhid, nlayers=cfg.nlayers,
                       init_range=cfg.init_range, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr)


class PsRole(BoardBacked):
    role = "ps"

    def __init__(self, cfg: PsConfig, metrics: Metrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.board = StatusBoard(self.role, cfg.name)
        self.endpoint = RpcEndpoint.for_role(cfg)
        self.membership = Membership(cfg.name, probe_interval=cfg.probe_interval,
                                     probe_failures=cfg.probe_failures,
                                     on_evicted=metrics.members_evicted.inc)
        self.server: ParameterServer | None = None
        self.store = CheckpointStore(cfg.checkpoint_dir)
        self.coordinator: checkpointing.Coordinator | None = None
        self._periodic: checkpointing.Periodic | None = None
        self._snapshots: dict[str, dict] = {}
        self._written: dict[str, int] = {}     # checkpoint id -> step, of parts written under an own manifest
        self._snapshots_lock = threading.Lock()
        self._stop = threading.Event()
        metrics.init_ps()

    # --- Controllable ------------------------------------------------------------------------------
    def start_episode(self, request: EpisodeStart) -> dict[str, Any]:
        raise NotSupported("parameter servers have no episodes; start them on the trainers")

    def stop_episode(self) -> dict[str, Any]:
        raise NotSupported("parameter servers have no episodes; stop them on the trainers")

    def checkpoint(self) -> dict[str, Any]:
        if self.coordinator is None:
            if not self.endpoint.joined:
                raise NotReady("not joined yet")
            result = checkpointing.ask_coordinator("take")
        else:
            result = self.coordinator.take()
        self.board.update(last_checkpoint={k: result[k] for k in ("id", "step", "path")})
        return result

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.store.list()]

    # --- checkpoint participant (called by the coordinator) --------------------------------------------
    def ckpt_prepare(self, cid: str) -> None:
        buffers = self.server.optimizer.copy_buffers()
        with self._snapshots_lock:
            self._snapshots[cid] = buffers

    def ckpt_snapshot(self, cid: str) -> int:
        with self._snapshots_lock:
            buffers = self._snapshots.get(cid)
        state = self.server.export_state(into=buffers if isinstance(buffers, tuple) else None)
        with self._snapshots_lock:
            self._snapshots[cid] = state
        return state["steps"]

    def ckpt_write(self, cid: str, step: int, meta: dict[str, Any]) -> tuple[FileEntry, bool]:
        """Write this shard into this server's checkpoint folder; True when ps0 shares the folder.
        Otherwise (a volume per server) the shard gets a manifest of its own beside it."""
        with self._snapshots_lock:
            state = self._snapshots[cid]
        name = f"{self.cfg.name}.pt"
        if (self.store.folder(step) / checkpointing.marker(cid)).exists():
            return self.store.write_file(step, name, state), True
        # A complete folder of this step here is a part whose cluster checkpoint was never committed.
        self.store.prepare(step, replace=True)
        with self._snapshots_lock:
            self._written[cid] = step
        entry = self.store.write_file(step, name, state)
        self.store.commit(step, [entry], {**meta, "server": self.cfg.name})
        return entry, False

    def ckpt_discard(self, cid: str, committed: bool = False) -> None:
        with self._snapshots_lock:
            self._snapshots.pop(cid, None)
            step = self._written.pop(cid, None)
        if step is None:
            return
        if committed:
            self.store.prune(self.cfg.keep_checkpoints)
        else:                # ps0 never committed it: it is no checkpoint of the cluster's
            shutil.rmtree(self.store.folder(step), ignore_errors=True)

    def ckpt_pause(self, cid: str, timeout: float) -> dict[str, Any]:
        raise NotSupported("servers are not paused; trainers are")

    def ckpt_resume(self, cid: str) -> None:
        raise NotSupported("servers are not paused; trainers are")

    # --- lifecycle -----------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        model = model_config(self.cfg)
        shard = parse_name(self.cfg.name).index
        resume, resume_from = self.cfg.resume, self.cfg.resume_from
        if self.endpoint.leader != self.cfg.name:
            self.board.set_state(RoleState.JOINING, f"asking {self.endpoint.leader} which checkpoint to restore")
            resume_from = checkpointing.follow_leader(self.endpoint.connect(), self.cfg.join_timeout)
            resume = resume_from is not None
            log.info("%s stands on %s", self.endpoint.leader, resume_from or "no checkpoint (a fresh start)")
        # Build before joining: once trainers can see this server, it must be able to answer.
        try:
            resumed, self.server = checkpointing.restore(
                self.store, resume, resume_from, model.model_dump(), shard, self.cfg.num_ps,
                lambda states: ParameterServer(self.cfg.name, shard, self.cfg.num_ps, model, self.metrics, restore=states))
        except CheckpointError as exc:
            if self.endpoint.leader == self.cfg.name or resume_from is None:
                raise
            raise CheckpointError(f"{self.endpoint.leader} resumed the cluster from {resume_from}, which this server "
                                  f"cannot restore from {self.store.root}: {exc}") from None
        if resumed is not None:
            self.board.update(resumed_from={"id": resumed.id, "step": resumed.step, "path": str(resumed.path)})
        info = self.server.info()
        log.info("shard %d of %d: %d vocabulary rows, LSTM layers %s, model %s",
                 shard, self.cfg.num_ps, info.rows, list(info.layers), model.model_dump())
        service.HOSTED.set(self.server)
        self.board.update(shard=shard, num_shards=self.cfg.num_ps, rows=info.rows, layers=list(info.layers),
                          model=model.model_dump())
        self.board.set_state(RoleState.JOINING, "joining the RPC group")
        self.membership.add_listener(self.server.forget)
        self.membership.install()
        checkpointing.PARTICIPANT.set(self)
        self.endpoint.join()
        if self.membership.is_leader:
            self.membership.start_leader(self.endpoint.store)
            announce = functools.partial(checkpointing.announce, self.endpoint.store)
            announce(resumed)
            self.coordinator = checkpointing.Coordinator(
                self.store, self.cfg.num_ps, {"model": model.model_dump()}, self.cfg.keep_checkpoints,
                local=self, metrics=self.metrics, resumed=resumed, on_commit=announce)
            checkpointing.COORDINATOR.set(self.coordinator)
            self._periodic = checkpointing.Periodic(self.checkpoint, lambda: self.server.optimizer.steps,
                                                    self.cfg.checkpoint_every_steps,
                                                    self.cfg.checkpoint_every_seconds).start()
        self.metrics.up.set(1)
        self.board.set_state(RoleState.RUNNING, "serving")
        while not self._stop.wait(1.0):
            members = current_members()
            self.metrics.members.set(len(members))
            self.board.update(members=members, steps=self.server.optimizer.steps)

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        if self._periodic is not None:
            self._periodic.stop()
        self._final_checkpoint()
        self.membership.stop()
        self.endpoint.leave()
        self.membership.uninstall()
        service.HOSTED.set(None)
        checkpointing.PARTICIPANT.set(None)
        checkpointing.COORDINATOR.set(None)
        if self.server is not None:
            self.server.close()

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
            take = functools.partial(checkpointing.ask_coordinator, "take_unless_saved", steps,
                                     timeout=FINAL_CHECKPOINT_SECONDS)
        checkpointing.take_final(take, FINAL_CHECKPOINT_SECONDS)
