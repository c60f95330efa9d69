"""The trainer role: joins the cluster, then runs language-model episodes on request.

Threads: the role thread (``run``) joins and trains (``trainer/lm/episodes.py``); the sidecar thread
calls the control methods, which only post requests under ``_lock`` and read the status board; the
checkpoint coordinator's RPCs hold training at a step boundary (``PositionPart``).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Optional

from torch.distributed import PrefixStore, Store

from ps.config import ps_names
from ps.stub import ClockPause, PsClient
from services.checkpoint.coordinator import Coordinator
from trainer.lm.config import TrainerConfig
from services.control import EpisodeGate, EpisodeStart, StepPause
from services.errors import BadRequest, ConfigError, PeerUnavailable
from services.lifecycle import RoleState
from services.membership import current_members
from services.names import parse_name
from services.remote import withdraw
from services.role import RoleBase, RoleContext
from services.torchrun import workers_store
from trainer.lm.config import dense_needs_sync
from trainer.lm.data import BatchStream, Corpus, trainer_share
from trainer.lm.dense import GROUP_PREFIX, ReplicaHold
from trainer.lm.episodes import EpisodeRunner
from trainer.lm.loop import TrainLoop
from trainer.lm.model import DistributedLM
from trainer.lm.position import PositionPart, move_to, position_of, resume_point

log = logging.getLogger(__name__)

REPORT_TIMEOUT = 5.0   # leaving the position with ps0 on the way out; a stop must stay bounded


class TrainerRole(RoleBase):
    role = "trainer"

    def __init__(self, cfg: TrainerConfig, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.gate = EpisodeGate(self._wake, "trainer", EpisodeStart(steps=cfg.steps) if cfg.start else None)
        self.pause = StepPause(self._wake, self.gate)
        self._episodes: Optional[EpisodeRunner] = None   # once joined and holding the model
        self._data = ""                                  # the corpus's description, saved with positions

    def start_episode(self, request: EpisodeStart) -> dict[str, Any]:
        if request.episodes is not None:
            raise BadRequest("a language-model trainer counts episodes in steps; send {\"steps\": N}")
        self.gate.start(request, self.board.ready())
        return {"started": True, "steps": request.steps}

    def stop_episode(self) -> dict[str, Any]:
        if not self.gate.stop():
            return {"stopping": False, "cancelled": True}
        return {"stopping": True, "at_step": self._episodes.steps if self._episodes else 0}

    def checkpoint(self) -> dict[str, Any]:
        return self._ask_coordinator(Coordinator.take)

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return self._ask_coordinator(Coordinator.listing, timeout=30)

    def _position(self) -> dict[str, Any]:
        episodes = self._episodes
        return position_of(episodes.loop, self.cfg.name, self.cfg.num_trainers, self._data, episodes.steps)

    def _restore_position(self, loop: TrainLoop) -> int:
        """Move ``loop`` to where the cluster's checkpoint left this trainer; the steps it had taken."""
        saved = self._ask_coordinator(Coordinator.positions, timeout=60)
        if saved is None:
            return 0
        point, why = resume_point(saved["states"], self.cfg.name, self.cfg.num_trainers, self._data,
                                  loop.stream.data.size(0))
        if point is None:
            log.warning("%s: starting this share from its beginning: %s", saved["checkpoint"], why)
            return 0
        move_to(loop, point)
        log.info("resumed position from %s (%s): token row %d of %d, epoch %d, step %d", saved["checkpoint"], why,
                 loop.stream.position, loop.stream.data.size(0), loop.stream.epoch, point.steps)
        return point.steps

    def _group_stores(self) -> Callable[[str], Store]:
        """Where the trainers' process groups meet (--dense allreduce): under torchrun, at its own
        store (its MASTER_ADDR/MASTER_PORT); else at the leader's, each under its own key."""
        timeout = self.cfg.group_timeout
        torchrun = workers_store(os.environ, timeout)
        if torchrun is None:
            log.info("the trainers' process groups meet at ps0's store")
            return lambda key: self.endpoint.prefixed_store(f"{GROUP_PREFIX}{key}/", timeout)
        store, address = torchrun
        log.info("the trainers' process groups meet at torchrun's store %s", address)
        return lambda key: PrefixStore(f"{GROUP_PREFIX}{key}/", store)

    def request_stop(self) -> None:
        self.gate.close()

    def run(self) -> None:
        cfg = self.cfg
        corpus = Corpus.load(cfg.data, synthetic_tokens=cfg.synthetic_tokens, seed=cfg.seed)
        index = parse_name(cfg.name).index % cfg.num_trainers
        train, heldout = trainer_share(corpus, index, cfg.num_trainers, cfg.batch_size, cfg.eval_tokens,
                                       cfg.eval_batch_size)
        log.info("data: %s; share %d of %d: %d training tokens", corpus.description, index, cfg.num_trainers, train.numel())
        self._data = corpus.description

        self._join("joining the RPC group")
        servers = ps_names(cfg.num_ps)
        self._await_members(servers, cfg.join_timeout, self._wake, lambda: self.gate.closing)
        client = PsClient(cfg.name, servers, timeout=cfg.rpc_timeout)
        model = DistributedLM(client, cfg.dropout)
        if corpus.ntoken > model.config.ntoken:
            raise PeerUnavailable(f"the corpus has {corpus.ntoken} word types but the servers' model only "
                                  f"{model.config.ntoken} rows; start the servers with --data or a larger --ntoken")
        if cfg.dense == "allreduce":
            try:
                dense_needs_sync(cfg.dense, str(client.consistency))
            except ValueError as exc:
                raise ConfigError(f"{exc} (the servers run {client.consistency})") from None
            model.replicate(self._group_stores(), cfg.num_trainers, cfg.group_timeout)
        loop = TrainLoop(model, BatchStream(train, cfg.bptt), cfg, self.metrics)
        steps = self._restore_position(loop)
        with self._lock:
            self._episodes = EpisodeRunner(loop, cfg, self.board, self.metrics, self.gate, self.pause, self._wake,
                                           heldout, self._heartbeat, steps)
        # In sync and ssp modes a checkpoint holds trainers at the step clock, where no barrier waits.
        hold = ClockPause(client) if client.consistency.clocked else self.pause
        if model.replica is not None:
            hold = ReplicaHold(hold, model.write_replica)
        self.checkpoints.add(PositionPart(cfg.name, hold, self._position))
        self.metrics.up.set(1)
        self.board.update(step=steps, episode=None, episodes_completed=0, members=current_members(),
                          model=client.model, data=corpus.description, consistency=str(client.consistency))
        self.board.set_state(RoleState.IDLE, "waiting for an episode")
        while True:
            request = self.gate.next(self._heartbeat)
            if request is None:
                return
            self._episodes.run(request)
            if cfg.exit_when_done:
                log.info("the episode started at launch is over: stopping (--exit-when-done)")
                return

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        withdraw(self.checkpoints)    # no checkpoint may hold it any more
        self._report_position()
        self._leave()

    def _report_position(self) -> None:
        """Tell ps0 where this trainer stopped, for the checkpoints taken after it is gone (and
        leave its replica's weights with the servers, under --dense allreduce)."""
        with self._lock:
            if self._episodes is None or not self.endpoint.joined:
                return
            position = self._position()
            model = self._episodes.loop.model
        if model.replica is not None:
            try:
                model.write_replica()
            except Exception as exc:  # noqa: BLE001 - a server may be gone already; stopping goes on
                log.warning("could not leave the replica's weights with the servers: %s", exc)
        try:
            self._ask_coordinator(Coordinator.left, self.cfg.name, position, timeout=REPORT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - ps0 may be gone already; stopping goes on
            log.warning("could not leave my position with ps0: %s", exc)
