"""The one ``main`` every role shares.

Main thread: signals and supervision. Role thread: ``role.run()`` (join, then serve or train).
Sidecar thread: HTTP. On SIGTERM/SIGINT the role is asked to stop at a step boundary and given a
bounded grace; RPC is always shut down (an exception with RPC still up can abort the interpreter).
"""
from __future__ import annotations

import functools
import logging
import os
import resource
import signal
import sys
import threading
import time
from typing import Any, NoReturn, Optional, Protocol

import torch
from prometheus_client import CollectorRegistry

from services.config import CommonConfig
from services.errors import RpcpsError
from services.http_server import SidecarServer
from services.leader import LEADER_LOST
from services.lease import FENCED, Lease, requeue_orphaned
from services.lifecycle import RoleState
from services.log import init_logging
from services.role import RoleContext
from services.sidecar import create_app
from services.workload import RoleSpec, resolve

log = logging.getLogger(__name__)

STOP_GRACE = 7.0  # seconds a role gets to reach a step boundary; leaves room inside a 10 s budget
FENCE_GRACE = 6.0  # seconds a fencing member gives its last words: a store to try (2 s), scontrol (4 s)


class Role(Protocol):
    role: str
    board: Any

    def run(self) -> None: ...
    def request_stop(self) -> None: ...
    def close(self) -> None: ...
    def leader_gone(self) -> bool: ...


class _RoleThread(threading.Thread):
    """``role.run()`` in a thread of its own, while the main thread waits for it or a signal."""

    def __init__(self, role: Role, leader_lost: threading.Event) -> None:
        super().__init__(name="role", daemon=True)
        self.role = role
        self._leader_lost = leader_lost
        self.failure: Optional[BaseException] = None
        self._ended = threading.Event()
        self._signalled = threading.Event()

    def run(self) -> None:
        try:
            self.role.run()
        except BaseException as exc:  # reported by the main thread
            self.failure = exc
        finally:
            self._ended.set()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        self._signalled.set()
        self._ended.set()

    def run_until_stopped(self, name: str) -> int:
        """Start the role, wait until it ends, a signal comes or the leader is lost, then give it a
        bounded grace to stop; its exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.start()
        # Signal handlers run only between the main thread's bytecodes: wake up to let them.
        while not self._ended.wait(0.5) and not self._leader_lost.is_set():
            pass
        self.role.request_stop()
        self.join(STOP_GRACE)
        exc = self.failure
        if self._leader_lost.is_set() or (exc is not None and not self._signalled.is_set() and self.role.leader_gone()):
            # What failed is the leader, not this member: its supervisor starts it again at once.
            log.warning("%s is out of its leader's group; exiting with code %d to rejoin", name, LEADER_LOST)
            return LEADER_LOST
        if exc is not None and self._signalled.is_set():
            # Asked to stop; what broke on the way out (e.g. a peer already gone) is not a failure.
            log.warning("while stopping: %s: %s", type(exc).__name__, str(exc).splitlines()[0])
        elif exc is not None:
            # rpcps's own errors say what went wrong; anything else is a bug, and its traceback tells where.
            log.error("%s failed: %s: %s", name, type(exc).__name__, exc,
                      exc_info=None if isinstance(exc, RpcpsError) else exc)
            self.role.board.set_state(RoleState.FAILED, f"{type(exc).__name__}: {exc}")
            return 1
        return 0


def _raise_fd_limit() -> None:
    """torch 2.13's RPC agent keeps its connections to every member that ever left (4 sockets per
    trainer a server sent to), so a long-lived server with churning trainers needs the hard limit
    on open files, not the usual soft 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)


def _fence_itself(cfg: CommonConfig, silent: float) -> NoReturn:
    """The lease ran out: its supervisor is about to declare this member lost and start another,
    so it stops serving now, before anything else of it can land (``services/lease.py``). Its
    log may be a pipe to a host it is cut off from (srun's), where a write blocks: the line is
    written by a thread of its own, given a few seconds (in a Slurm job, a lost batch node has
    it requeue the job first), and the process ends either way."""
    def say() -> None:
        requeued = requeue_orphaned(cfg.requeue_job, (cfg.master_addr, cfg.master_port))
        log.error("%s fenced itself: its supervisor has not renewed its lease for %.0fs%s", cfg.name, silent,
                  f"; {requeued}" if requeued else "")
        logging.shutdown()
    said = threading.Thread(target=say, daemon=True)
    said.start()
    said.join(FENCE_GRACE)
    os._exit(FENCED)


def _hear_supervisor(lease: Lease) -> None:
    """A member of a Slurm job leaves a lost leader for its supervisor to start it again, but
    under Slurm the supervisor ran on the leader's node: it waits, its sidecar up, for one more
    ask. If the supervisor asks (within a second, normally), it leaves as usual; if not, the lease
    runs out and fencing requeues the job (``_fence_itself``), for nothing else would start it."""
    left = time.monotonic()
    while time.monotonic() - left < lease.timeout + FENCE_GRACE + 1:
        if lease.silent_for() < time.monotonic() - left:
            return                  # asked since it left: the supervisor is there
        time.sleep(0.1)  # noqa: sleep-ok (a watch of the lease's clock; the fence thread ends the wait)


def run_role(cfg: CommonConfig, spec: RoleSpec) -> NoReturn:
    """Run the role ``spec`` describes, as ``cfg`` sets it, until it ends or a signal stops it;
    exit the process with its code."""
    init_logging(cfg.name, cfg.log_level)
    torch.set_num_threads(cfg.threads)
    _raise_fd_limit()
    registry = CollectorRegistry()
    context = RoleContext.build(cfg, spec.name, spec.metrics(registry, spec.name, cfg.name), spec.status)
    role: Role = spec.build()(cfg, context)
    context.metrics.restarts_in_a_row.set(cfg.restarts_in_a_row)
    context.board.update(restarts_in_a_row=cfg.restarts_in_a_row)
    token = cfg.control_token.get_secret_value() if cfg.control_token else None
    routes = resolve(spec.routes) if spec.routes else None
    lease = context.lease
    sidecar = SidecarServer(create_app(role, registry, token, routes, lease), cfg.sidecar_host, cfg.sidecar_port,
                            cfg.http_read_timeout).start()
    if lease is not None:
        lease.watch(functools.partial(_fence_itself, cfg))
    log.info("%s %s: sidecar %s", spec.name, cfg.name, sidecar.url)
    worker = _RoleThread(role, context.leader_lost)
    code = worker.run_until_stopped(cfg.name)
    if code == LEADER_LOST and lease is not None and cfg.requeue_job:
        _hear_supervisor(lease)
    try:
        role.close()
    except Exception:
        log.exception("error while closing")
    sidecar.stop()
    if worker.is_alive():
        # Stuck in a blocking wait torch cannot interrupt (a store wait, an RPC to a dead peer).
        log.warning("role thread did not stop within %.0fs; exiting anyway", STOP_GRACE)
    else:
        log.info("%s stopped (exit %d)", cfg.name, code)
    # Everything worth keeping is on disk (checkpoints are fsynced) or flushed here. The
    # interpreter's own teardown of torch would take another second for nothing, and a stuck
    # thread would block it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
