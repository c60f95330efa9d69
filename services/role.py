"""What every role is handed, and the skeleton every role shares.

The runtime builds a ``RoleContext`` once per process and gives it to the role, so a role builds
none of its collaborators: a unit test hands it fakes instead and exercises the role's logic
without joining RPC.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from services.checkpoint.coordinator import TAKE_TIMEOUT, ask_coordinator
from services.checkpoint.member import CheckpointMember
from services.checkpoint.store import CheckpointStore
from services.errors import NotReady, NotSupported, PeerUnavailable
from services.leader import LeaderWatch
from services.lease import Lease
from services.lifecycle import RoleState, RoleStatus, StatusBoard
from services.membership import Membership, current_members, reachable
from services.metrics import Metrics
from services.remote import serve, withdraw
from services.rpc import RpcEndpoint


@dataclass
class RoleContext:
    """A role's collaborators."""

    metrics: Metrics
    board: StatusBoard
    endpoint: RpcEndpoint
    membership: Membership
    store: CheckpointStore
    checkpoints: CheckpointMember     # this process's side of cluster checkpoints; roles add their parts
    leader_lost: threading.Event = field(default_factory=threading.Event)   # set once; the process then leaves
    lease: Optional[Lease] = None     # with its supervisor (services/lease.py), whose deadline judges silence

    @classmethod
    def build(cls, cfg: Any, role: str, metrics: Metrics, status: type[RoleStatus] = RoleStatus) -> "RoleContext":
        """The real ones, as ``cfg`` (a ``services.config.CommonConfig``) describes them; the
        status board keeps to the role's ``status`` schema."""
        store = CheckpointStore(cfg.checkpoint_dir)
        return cls(metrics=metrics, board=StatusBoard(role, cfg.name, status), endpoint=RpcEndpoint.for_role(cfg),
                   membership=Membership.for_role(cfg, on_evicted=metrics.members_evicted.inc),
                   store=store, checkpoints=CheckpointMember(cfg.name, store),
                   lease=Lease(cfg.lease_timeout) if cfg.lease_timeout else None)


class RoleBase:
    """Health, readiness and status from the board; joining and leaving the group; the members
    heartbeat. A role adds ``run``/``request_stop``/``close`` and its control methods."""

    role: ClassVar[str]

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.metrics, self.board, self.endpoint = ctx.metrics, ctx.board, ctx.endpoint
        self.membership, self.store, self.checkpoints = ctx.membership, ctx.store, ctx.checkpoints
        self._watch: Optional[LeaderWatch] = None     # every member but the leader, once joined

    def healthy(self) -> tuple[bool, str]:
        return self.board.healthy()

    def ready(self) -> tuple[bool, str]:
        return self.board.ready()

    def status(self) -> dict[str, Any]:
        return self.board.snapshot()

    def _join(self, why: str, note: Optional[dict] = None) -> dict:
        """Serve this role's RPC surfaces and join the group (as the leader, start leading); the
        leader's reply to ``note``."""
        self.board.set_state(RoleState.JOINING, why)
        self.membership.install()
        serve(self)
        serve(self.checkpoints)
        reply = self.endpoint.join(note)
        if self.membership.is_leader:
            self.membership.start_leader(self.endpoint.store)
        else:
            lease = self.ctx.lease
            self._watch = LeaderWatch(self.endpoint.reader(), lambda why: self.ctx.leader_lost.set(),
                                      evicted=self.endpoint.evicted(), silence=lease.timeout if lease else None,
                                      cut_off=lease.cut_off if lease else None).start()
        return reply

    def leader_gone(self) -> bool:
        """Whether this member has lost its leader (asked once more now, after a failure)."""
        if not self.ctx.leader_lost.is_set() and self._watch is not None and self._watch.verdict() is not None:
            self.ctx.leader_lost.set()
        return self.ctx.leader_lost.is_set()

    def _leave(self) -> None:
        """Leave the group without waiting on any other member; serve nothing any more."""
        if self._watch is not None:
            self._watch.stop()
        self.membership.stop()
        self.endpoint.leave()
        self.membership.uninstall()
        withdraw(self)
        withdraw(self.checkpoints)

    def _ask_coordinator(self, method: Callable[..., Any], *args: Any, timeout: float = TAKE_TIMEOUT) -> Any:
        """``method`` (one of ``services.checkpoint.coordinator.Coordinator``'s) on the leader."""
        self._require_joined()
        return ask_coordinator(self.endpoint.leader, method, *args, timeout=timeout)

    def _require_joined(self) -> None:
        if not self.endpoint.joined:
            raise NotReady("not joined yet")

    def _await_members(self, names: list[str], timeout: float, wake: threading.Condition,
                       stopping: Callable[[], bool]) -> None:
        """Until every one of ``names`` is in the group and answers (torch lists a member a moment
        before it can be called), or ``PeerUnavailable`` after ``timeout`` or once ``stopping()``."""
        deadline = time.monotonic() + timeout
        confirmed: set[str] = set()
        while True:
            members = set(current_members())
            confirmed |= {n for n in names if n in members and n not in confirmed and reachable(n)}
            missing = [n for n in names if n not in confirmed]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise PeerUnavailable(f"{', '.join(missing)} did not join within {timeout:.0f}s")
            self.board.set_state(RoleState.JOINING, f"waiting for {', '.join(missing)}")
            with wake:
                if stopping():
                    raise PeerUnavailable(f"stopped while waiting for {', '.join(missing)}")
                wake.wait(0.2)

    def _heartbeat(self) -> list[str]:
        """The members as this process sees them, on the board and in the metrics."""
        members = current_members()
        self.metrics.members.set(len(members))
        self.board.update(members=members)
        return members


class WithoutEpisodes:
    """A role whose work is not started and stopped in episodes. ``no_episodes`` says where they
    are, with ``{}`` for "start" or "stop"."""

    no_episodes: ClassVar[str]

    def start_episode(self, request: Any) -> dict[str, Any]:
        raise NotSupported(self.no_episodes.format("start"))

    def stop_episode(self) -> dict[str, Any]:
        raise NotSupported(self.no_episodes.format("stop"))
