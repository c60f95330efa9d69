"""Role state and the status board that /status, /readyz and the metrics read.

The work loop, RPC handler threads and the sidecar thread all touch the board, so every read and
write goes through one lock and readers get a copy.
"""
from __future__ import annotations

import enum
import threading
import time
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from services.progress import ProgressStatus, clock


class RoleState(str, enum.Enum):
    STARTING = "starting"      # process up, not yet in the RPC group
    JOINING = "joining"        # waiting for the leader / peers
    IDLE = "idle"              # joined and ready; waiting for an episode
    RUNNING = "running"        # an episode (or serving, for servers) is under way
    STOPPING = "stopping"      # shutting down
    FAILED = "failed"          # unrecoverable; the process is about to exit


READY_STATES = {RoleState.IDLE, RoleState.RUNNING}


class RoleStatus(BaseModel):
    """What every role's /status holds; each role's schema adds its own fields (``RoleSpec.status``).
    Every field has a default, so a status not yet read is the empty one."""

    model_config = ConfigDict(extra="forbid")
    role: str = ""
    name: str = ""
    state: str = "unknown"
    reason: str = ""
    members: Optional[list[str]] = None
    resumed_from: Optional[dict[str, Any]] = None
    restarts_in_a_row: int = 0
    last_checkpoint: Optional[dict[str, Any]] = None
    progress: Optional[ProgressStatus] = None   # the work under way: done of total, ETA
    summary: list[str] = []            # ``line()`` as the role itself read it: `rpcps status` prints it as it is

    def line(self) -> list[str]:
        """The columns `rpcps status` prints after the name, the role and the state."""
        return [self.reason]

    def eta(self) -> list[str]:
        """``ETA 1:18`` while bounded work is under way (a column for ``line``), else nothing."""
        p = self.progress
        if p is None or p.total is None or p.done >= p.total:
            return []
        return [f"{p.phase} ETA {clock(p.eta_s)}"]


class StatusBoard:
    def __init__(self, role: str, name: str, schema: type[RoleStatus] = RoleStatus) -> None:
        self._lock = threading.Lock()
        self._role, self._name, self._schema = role, name, schema
        self._known = set(schema.model_fields) - {"role", "name", "state", "reason", "summary"}
        self._state = RoleState.STARTING
        self._reason = "starting"
        self._fields: dict[str, Any] = {}
        self._beat = time.monotonic()

    def set_state(self, state: RoleState, reason: str = "") -> None:
        with self._lock:
            self._state, self._reason = state, reason or state.value
            self._beat = time.monotonic()

    @property
    def state(self) -> RoleState:
        with self._lock:
            return self._state

    def update(self, **fields: Any) -> None:
        unknown = fields.keys() - self._known
        if unknown:  # a key the role's schema lacks: readers would never see it
            raise KeyError(f"{self._role} status has no field {', '.join(sorted(unknown))}")
        with self._lock:
            self._fields.update(fields)
            self._beat = time.monotonic()

    def ready(self) -> tuple[bool, str]:
        with self._lock:
            return self._state in READY_STATES, self._reason

    def healthy(self, max_silence: float = 120.0) -> tuple[bool, str]:
        """Liveness: not failed, and the role's loop has shown a sign of life recently."""
        with self._lock:
            if self._state == RoleState.FAILED:
                return False, f"failed: {self._reason}"
            silent = time.monotonic() - self._beat
        if silent > max_silence:
            return False, f"no sign of life for {silent:.0f}s"
        return True, "ok"

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            snap = {"role": self._role, "name": self._name, "state": self._state.value,
                    "reason": self._reason, **{k: _copy(v) for k, v in self._fields.items()}}
        # Rendered here, so a reader needs no schema (and `rpcps status` does not import pydantic).
        return {**snap, "summary": self._schema.model_validate(snap).line()}


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy(x) for x in v]
    return v
