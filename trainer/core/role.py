"""The trainer role of a server-hosted workload: joins the cluster, then runs episodes on request.
A workload's trainer is this with two parts of its own: ``prepare`` (read its data, before
joining, so bad data ends it before anything waits for it) and ``task`` (its model over the
servers' client, and how it trains and evaluates: ``trainer.core.loop.Task``).

Threads: the role thread (``run``) joins and trains (``trainer/core/episodes.py``); the sidecar
thread calls the control methods, which only post requests under ``_lock`` and read the status
board; the checkpoint coordinator's RPCs hold training at a step boundary (``PositionPart``).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Optional

from torch.distributed import PrefixStore, Store

from ps.spec.config import ps_names
from ps.spec.surface import PsSurface
from ps.client.cache import HotRows
from ps.client.client import PsClient, leaders_layout
from ps.client.clock import ClockPause
from services.checkpoint.coordinator import Coordinator
from services.control import EpisodeGate, EpisodeStart, StepPause
from services.errors import BadRequest, ConfigError, NotReady, NotSupported
from services.lifecycle import RoleState
from services.membership import current_members
from services.remote import withdraw
from services.role import RoleBase, RoleContext
from services.torchrun import workers_store
from trainer.core.config import TrainerSettings, dense_for, replicated_rows_need_replica
from trainer.core.episodes import EpisodeRunner
from trainer.core.loop import Task, TrainLoop
from trainer.core.position import PositionPart, resume_from
from trainer.core.replica import GROUP_PREFIX, ReplicaHold

log = logging.getLogger(__name__)

REPORT_TIMEOUT = 5.0   # leaving the position with ps0 on the way out; a stop must stay bounded


class ServedTrainer(RoleBase):
    def __init__(self, cfg: TrainerSettings, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.gate = EpisodeGate(self._wake, self.role, EpisodeStart(steps=cfg.steps) if cfg.start else None)
        self.pause = StepPause(self._wake, self.gate)
        self._episodes: Optional[EpisodeRunner] = None   # once joined and holding the model
        self._client: Optional[PsClient] = None

    def counts(self) -> dict[str, Any]:
        """``GET /counts``: the row updates of this trainer's acknowledged steps, by slot, when
        the servers count theirs (``ps/client/counts.py``)."""
        client = self._client
        if client is None:
            raise NotReady(f"{self.cfg.name} has not reached the servers yet")
        if client.counts is None:
            raise NotSupported("the servers do not count updates: start every server with --count-updates")
        return client.counts.snapshot()

    # What a workload's trainer adds.
    def prepare(self) -> None:
        """Before joining: read and check the data (an error here ends the role before it joins)."""

    def task(self, client: PsClient) -> Task:
        """The workload's model over ``client`` and its training and evaluation."""
        raise NotImplementedError

    def evaluates(self) -> bool:
        """Whether episodes end with a held-out evaluation."""
        return True

    def prefetch(self) -> int:
        """How many batches a step's reads go out ahead of (``trainer/core/prefetch.py``; 0: none)."""
        return 0

    def place_backward(self, client: PsClient) -> None:
        """Where the steps' backward runs (``PsClient.backward_here``): by distributed autograd
        unless the workload knows its servers compute none of its forward."""

    def cache(self) -> Optional[HotRows]:
        """Copies of the rows read most, kept here (``ps/client/cache.py``; None: none)."""
        return None

    # Control (the sidecar thread).
    def start_episode(self, request: EpisodeStart) -> dict[str, Any]:
        if request.episodes is not None:
            raise BadRequest("a trainer counts episodes in steps; send {\"steps\": N}")
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

    def request_stop(self) -> None:
        self.gate.close()

    def _position(self) -> dict[str, Any]:
        episodes = self._episodes
        return episodes.loop.position(episodes.steps)

    def _restore_position(self, task: Task, client: PsClient) -> int:
        """Move ``task`` to where the cluster's checkpoint left this trainer, or past it to after
        its last batch every server applied; the steps it had taken."""
        saved = self._ask_coordinator(Coordinator.positions, timeout=60)
        if getattr(task, "exactly_once", False):
            saved = resume_from(saved, [client.call(n, PsSurface.applied_mark, self.cfg.name)
                                        for n in client.routes.servers], self.cfg.name)
        return 0 if saved is None else task.restore(saved["states"], saved["checkpoint"])

    def _group_wait(self) -> float:
        """How long the trainers' process group waits for a member: ``--group-timeout``, but no
        longer than ``--rpc-timeout``, which ``rpcps up`` sets to its member timeout (a peer silent
        that long is lost, and is fenced: no wait on it lasts longer)."""
        return min(self.cfg.group_timeout, self.cfg.rpc_timeout)

    def _group_stores(self) -> Callable[[str], Store]:
        """Where the trainers' process groups meet (--dense allreduce): under torchrun, at its own
        store (its MASTER_ADDR/MASTER_PORT); else at the leader's, each under its own key."""
        timeout = self._group_wait()
        torchrun = workers_store(os.environ, timeout)
        if torchrun is None:
            log.info("the trainers' process groups meet at ps0's store")
            return lambda key: self.endpoint.prefixed_store(f"{GROUP_PREFIX}{key}/", timeout)
        store, address = torchrun
        log.info("the trainers' process groups meet at torchrun's store %s", address)
        return lambda key: PrefixStore(f"{GROUP_PREFIX}{key}/", store)

    def run(self) -> None:
        cfg = self.cfg
        self.prepare()
        self._join("joining the RPC group")
        # The servers are the leader's layout's, which a change may have made other than the
        # --num-ps this trainer was started with (one started again after the job shrank).
        leader = ps_names(cfg.num_ps)[0]
        self._await_members([leader], cfg.join_timeout, self._wake, lambda: self.gate.closing)
        servers = list(leaders_layout(leader, cfg.rpc_timeout).servers)
        self._await_members(servers, cfg.join_timeout, self._wake, lambda: self.gate.closing)
        client = PsClient(cfg.name, servers, timeout=cfg.rpc_timeout)
        self._client = client
        client.clock.start_with = cfg.num_trainers        # sync: the job's first step waits for them all
        task = self.task(client)
        self.place_backward(client)
        model = task.model
        cache = self.cache()
        replicated = cache is not None and cache.replicated
        if replicated and client.counts is not None:
            raise ConfigError("the servers count updates (--count-updates), and hot rows replicated on the trainers "
                              "are written back to them whole, not by update: give --cache-staleness 1 or more")
        try:        # where the dense weights live is the servers' consistency's to allow, or to choose
            dense = dense_for(cfg.dense, str(client.consistency))
            replicated_rows_need_replica(replicated, 0, dense)
        except ValueError as exc:
            raise ConfigError(f"{exc} (the servers run {client.consistency})") from None
        if dense == "allreduce":
            model.replicate(self._group_stores(), self._group_wait(), hot=cache if replicated else None)
        try:
            loop = TrainLoop.of(task, cfg, self.metrics, self.prefetch(), cache)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        steps = self._restore_position(task, client)
        with self._lock:
            self._episodes = EpisodeRunner(loop, cfg, self.board, self.metrics, self.gate, self.pause, self._wake,
                                           self.evaluates(), self._heartbeat, steps, tell=self._tell_position)
        # In sync and ssp modes a checkpoint holds trainers at the step clock, where no barrier waits.
        hold = ClockPause(client.ask, client.leader) if client.consistency.clocked else self.pause
        if model.replica is not None:
            hold = ReplicaHold(hold, model.write_replica)
        self.checkpoints.add(PositionPart(cfg.name, hold, self._position, before_resuming=client.follow_layout))
        self.metrics.up.set(1)
        self.board.update(step=steps, episode=None, episodes_completed=0, members=current_members(),
                          model=client.model, data=task.data, consistency=str(client.consistency))
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

    def _tell_position(self) -> None:
        """Waiting for data (the training thread, at a step boundary): tell ps0 where this trainer
        is, so a replacement goes on from here (``Coordinator.tell``)."""
        try:
            self._ask_coordinator(Coordinator.tell, self.cfg.name, self._position(), timeout=REPORT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - ps0 away: the checkpoints' positions still hold
            log.warning("could not tell ps0 where I wait: %s", exc)

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
            self._ask_coordinator(Coordinator.tell, self.cfg.name, position, timeout=REPORT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - ps0 may be gone already; stopping goes on
            log.warning("could not leave my position with ps0: %s", exc)
