"""The trainer role: joins the cluster, then runs language-model episodes on request.

Threads: the role thread (``run``) joins and trains; the sidecar thread calls the control methods,
which only post requests under ``_lock`` and read the status board.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Optional

from ps.stub import PsClient
from services import checkpointing
from services.config import TrainerConfig
from services.control import BoardBacked, EpisodeGate, EpisodeStart
from services.errors import BadRequest, NotReady, NotSupported, PeerUnavailable
from services.lifecycle import RoleState, StatusBoard
from services.membership import Membership, current_members, reachable
from services.metrics import Metrics
from services.names import parse_name, ps_names
from services.rpc import RpcEndpoint
from trainer.data import BatchStream, Corpus, batchify, share
from trainer.position import resume_point
from trainer.loop import EvalResult, TrainLoop
from trainer.model import DistributedLM

log = logging.getLogger(__name__)

REPORT_TIMEOUT = 5.0   # leaving the position with ps0 on the way out; a stop must stay bounded


class TrainerRole(BoardBacked):
    role = "trainer"

    def __init__(self, cfg: TrainerConfig, metrics: Metrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.board = StatusBoard(self.role, cfg.name)
        self.endpoint = RpcEndpoint.for_role(cfg)
        self.membership = Membership(cfg.name)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.gate = EpisodeGate(self._wake, "trainer", EpisodeStart(steps=cfg.steps) if cfg.start else None)
        self._episodes = 0
        self._steps = 0
        self._pause_requested = False
        self._paused = False       # held at a step boundary for a checkpoint
        self._evaluating = False   # evaluation changes neither parameters nor position: as good as paused
        self._loop: Optional[TrainLoop] = None
        self._data_description = ""
        metrics.init_trainer()

    # --- Controllable ------------------------------------------------------------------------------
    def start_episode(self, request: EpisodeStart) -> dict[str, Any]:
        if request.episodes is not None:
            raise BadRequest("a language-model trainer counts episodes in steps; send {\"steps\": N}")
        self.gate.start(request, self.board.ready())
        return {"started": True, "steps": request.steps}

    def stop_episode(self) -> dict[str, Any]:
        if not self.gate.stop():
            return {"stopping": False, "cancelled": True}
        return {"stopping": True, "at_step": self._steps}

    def checkpoint(self) -> dict[str, Any]:
        if not self.endpoint.joined:
            raise NotReady("not joined yet")
        return checkpointing.ask_coordinator("take")

    def list_checkpoints(self) -> list[dict[str, Any]]:
        if not self.endpoint.joined:
            raise NotReady("not joined yet")
        return checkpointing.ask_coordinator("listing", timeout=30)

    # --- checkpoint participant (called by the coordinator on ps0) ----------------------------------------
    def ckpt_pause(self, cid: str, timeout: float) -> dict[str, Any]:
        """Hold training at the next step boundary and describe where this trainer is."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._loop is None:
                raise NotReady("not training yet")
            self._pause_requested = True
            self._wake.notify_all()
            while self.gate.running and not (self._paused or self._evaluating):
                if not self._wake.wait(max(0.0, deadline - time.monotonic())):
                    self._pause_requested = False
                    self._wake.notify_all()
                    raise checkpointing.CheckpointError(f"{self.cfg.name} did not reach a step boundary in {timeout:.0f}s")
            return self._position()

    def ckpt_resume(self, cid: str) -> None:
        with self._lock:
            self._pause_requested = False
            self._wake.notify_all()

    def ckpt_prepare(self, cid: str) -> None:
        raise NotSupported("trainers hold no parameters")

    def ckpt_snapshot(self, cid: str) -> int:
        raise NotSupported("trainers hold no parameters")

    def ckpt_write(self, cid: str, root: str, step: int):
        raise NotSupported("trainers hold no parameters")

    def ckpt_discard(self, cid: str) -> None:
        pass

    def _position(self) -> dict[str, Any]:
        loop = self._loop
        return {"name": self.cfg.name, "num_trainers": self.cfg.num_trainers, "data": self._data_description,
                "position": loop.stream.position, "epoch": loop.stream.epoch, "rows": loop.stream.data.size(0),
                "hidden": [loop.hidden[0].clone(), loop.hidden[1].clone()], "steps": self._steps}

    def _restore_position(self, loop: TrainLoop) -> None:
        saved = checkpointing.ask_coordinator("trainer_states", timeout=60)
        if saved is None:
            return
        point, why = resume_point(saved["trainers"], self.cfg.name, self.cfg.num_trainers, self._data_description,
                                  loop.stream.data.size(0))
        if point is None:
            log.warning("%s: starting this share from its beginning: %s", saved["checkpoint"], why)
            return
        loop.stream.position, loop.stream.epoch, self._steps = point.position, point.epoch, point.steps
        if point.hidden is not None and tuple(point.hidden[0].shape) == tuple(loop.hidden[0].shape):
            loop.hidden = (point.hidden[0], point.hidden[1])
        log.info("resumed position from %s (%s): token row %d of %d, epoch %d, step %d", saved["checkpoint"], why,
                 loop.stream.position, loop.stream.data.size(0), loop.stream.epoch, self._steps)

    # --- lifecycle -----------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self.gate.close()

    def run(self) -> None:
        cfg = self.cfg
        corpus = Corpus.load(cfg.data, synthetic_tokens=cfg.synthetic_tokens, seed=cfg.seed)
        index = parse_name(cfg.name).index % cfg.num_trainers
        train = batchify(share(corpus.train, index, cfg.num_trainers), cfg.batch_size)
        heldout = None
        if corpus.heldout is not None:
            heldout = share(corpus.heldout, index, cfg.num_trainers)
            if cfg.eval_tokens is not None:
                heldout = heldout[: max(cfg.eval_tokens // cfg.num_trainers, cfg.eval_batch_size * 2)]
        log.info("data: %s; share %d of %d: %d training tokens", corpus.description, index, cfg.num_trainers, train.numel())
        self._data_description = corpus.description

        self.board.set_state(RoleState.JOINING, "joining the RPC group")
        self.membership.install()
        checkpointing.PARTICIPANT.set(self)
        self.endpoint.join()
        servers = ps_names(cfg.num_ps)
        self._wait_for(servers)
        client = PsClient(cfg.name, servers, timeout=cfg.rpc_timeout)
        if corpus.ntoken > client.model.ntoken:
            raise PeerUnavailable(f"the corpus has {corpus.ntoken} word types but the servers' model only "
                                  f"{client.model.ntoken} rows; start the servers with --data or a larger --ntoken")
        loop = TrainLoop(DistributedLM(client, cfg.dropout), client.optimizer(), BatchStream(train, cfg.bptt),
                         cfg, self.metrics)
        self._restore_position(loop)
        with self._lock:
            self._loop = loop
        self.metrics.up.set(1)
        self.board.update(step=self._steps, episode=None, episodes_completed=0, members=current_members(),
                          model=client.model.model_dump(), data=corpus.description)
        self.board.set_state(RoleState.IDLE, "waiting for an episode")
        while True:
            request = self.gate.next(self._report_members)
            if request is None:
                return
            self._run_episode(loop, request, heldout)

    def _hold_while_paused(self) -> None:
        """At a step boundary, with ``_lock`` held: wait out a checkpoint's pause."""
        while self._pause_requested and not self.gate.closing:
            self._paused = True
            self._wake.notify_all()
            self._wake.wait(1.0)
        self._paused = False

    def _report_members(self) -> None:
        members = current_members()
        self.metrics.members.set(len(members))
        self.board.update(members=members)

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        checkpointing.PARTICIPANT.set(None)
        self._report_position()
        self.endpoint.leave()
        self.membership.uninstall()

    def _report_position(self) -> None:
        """Tell ps0 where this trainer stopped, for the checkpoints taken after it is gone."""
        with self._lock:
            if self._loop is None or not self.endpoint.joined:
                return
            position = self._position()
        try:
            checkpointing.ask_coordinator("trainer_left", position, timeout=REPORT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - ps0 may be gone already; stopping goes on
            log.warning("could not leave my position with ps0: %s", exc)

    def _wait_for(self, servers: list[str]) -> None:
        deadline = time.monotonic() + self.cfg.join_timeout
        confirmed: set[str] = set()
        while True:
            members = set(current_members())
            confirmed |= {s for s in servers if s in members and s not in confirmed and reachable(s)}
            missing = sorted(set(servers) - confirmed)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise PeerUnavailable(f"servers {missing} did not join within {self.cfg.join_timeout:.0f}s")
            self.board.set_state(RoleState.JOINING, f"waiting for {', '.join(missing)}")
            with self._lock:
                if self.gate.closing:
                    raise PeerUnavailable("stopped while waiting for the servers")
                self._wake.wait(0.2)

    def _run_episode(self, loop: TrainLoop, request: EpisodeStart, heldout) -> None:
        self._episodes += 1
        target = request.steps
        episode = {"id": self._episodes, "step": 0, "steps": target, "done": False}
        self.board.update(episode=dict(episode))
        self.board.set_state(RoleState.RUNNING, f"episode {self._episodes}")
        self.metrics.episode_running.set(1)
        log.info("episode %d: %s steps", self._episodes, target or "unbounded")
        recent = deque(maxlen=20)
        first_loss = None
        timed_tokens, timed_seconds = 0, 0.0
        timed = {"tokens": 0, "start": None, "end": None}  # wall clock, comparable across trainers
        last_log = time.monotonic()
        try:
            while target is None or episode["step"] < target:
                with self._lock:
                    self._hold_while_paused()
                    if self.gate.stop_requested:
                        break
                started = time.time()
                r = loop.step()
                self._steps += 1
                episode["step"] += 1
                first_loss = r.loss if first_loss is None else first_loss
                recent.append(r.loss)
                if episode["step"] > self.cfg.warmup_steps:  # warm-up pays connection set-up and allocation
                    timed_tokens += r.tokens
                    timed_seconds += r.seconds
                    timed = {"tokens": timed_tokens, "start": timed["start"] or started, "end": time.time()}
                tps = timed_tokens / timed_seconds if timed_seconds else r.tokens / r.seconds
                self.metrics.tokens_per_second.set(tps)
                self.board.update(step=self._steps, episode=dict(episode), loss=r.loss,
                                  loss_avg=sum(recent) / len(recent), loss_first=first_loss,
                                  tokens_per_s=tps, grad_norm=r.grad_norm, timed=dict(timed),
                                  step_seconds={k: round(v, 6) for k, v in r.phases.items()})
                if time.monotonic() - last_log >= self.cfg.log_interval:
                    last_log = time.monotonic()
                    self._report_members()
                    log.info("step %d | loss %.3f | %.0f tokens/s", self._steps, sum(recent) / len(recent), tps)
            with self._lock:
                shutting_down = self.gate.closing
            if heldout is not None and not shutting_down and episode["step"] > 0:
                self.board.update(evaluating=True)
                with self._lock:
                    self._evaluating = True
                    self._wake.notify_all()
                try:
                    result: EvalResult = loop.evaluate(heldout, should_stop=lambda: self.gate.closing)
                finally:
                    with self._lock:
                        self._evaluating = False
                self.metrics.eval_loss.set(result.loss)
                self.board.update(evaluating=False, eval={"loss_sum": result.loss_sum, "tokens": result.tokens,
                                                          "loss": result.loss, "ppl": result.ppl})
                log.info("episode %d held-out share: loss %.3f ppl %.1f over %d tokens",
                         self._episodes, result.loss, result.ppl, result.tokens)
        finally:
            episode["done"] = True
            self.metrics.episodes.inc()
            self.board.update(episode=dict(episode), episodes_completed=self._episodes)
            self.metrics.episode_running.set(0)
            self.gate.finish()
            self.board.set_state(RoleState.IDLE, "waiting for an episode")
            log.info("episode %d done after %d steps", self._episodes, episode["step"])
