"""``Local``: every member a process of this machine (``rpcps up`` without ``--emulate-hosts`` or
``--slurm``), and the sidecar ports every placement but Slurm's gives."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from supervise.placement import Placed, launcher_ended
from supervise.processes import free_port, spawn_role


class LocalProcess(Placed):
    """A member that is a process of this machine: signals go to it."""

    kind = "local"

    @classmethod
    def found(cls, described: dict[str, Any]) -> "LocalProcess":
        return cls(int(described["pid"]))

    def send_signal(self, sig: int) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:      # gone already: nothing left to signal
            pass

    def where(self) -> str:
        return f"as process {self.pid} of this machine"


class _PortsInOrder:
    """Sidecar ports as ``--sidecar-port`` says: from the first, one per member in plan order;
    unset (0), a free port of this machine each."""

    def __init__(self, first_port: int) -> None:
        self._first_port = first_port
        self._order: dict[str, int] = {}

    def _number(self, names: list[str]) -> None:
        self._order = {name: i for i, name in enumerate(names)}

    def add(self, name: str) -> None:
        self._order.setdefault(name, len(self._order))

    def sidecar_port(self, name: str) -> int:
        return self._first_port + self._order[name] if self._first_port else free_port()


class Local(_PortsInOrder):
    """Every member a process of this machine, its sidecar at ``--sidecar-host``."""

    handle = LocalProcess

    run_ended = staticmethod(launcher_ended)

    @classmethod
    def from_settings(cls, cfg: Any) -> "Local":
        return cls(cfg.master_addr, cfg.sidecar_host, cfg.sidecar_port)

    def __init__(self, master_addr: str, sidecar_host: str, first_port: int = 0) -> None:
        super().__init__(first_port)
        self._master_addr, self._sidecar_host = master_addr, sidecar_host

    def create(self, names: list[str]) -> None:
        self._number(names)

    def remove(self, name: str) -> None:
        pass            # nothing of a process of this machine is left once it exited (its port is kept)

    def master_addr(self, leader: str) -> str:
        return self._master_addr

    def sidecar_host(self, name: str) -> str:
        return self._sidecar_host

    def reach(self, name: str) -> str:
        """The address this machine reaches member ``name``'s sidecar at."""
        return "127.0.0.1" if self._sidecar_host in ("0.0.0.0", "") else self._sidecar_host

    def spawn(self, name: str, argv: list[str], log_path: Path, env: dict) -> LocalProcess:
        proc = spawn_role("supervise.cli", argv, log_path, env)
        return LocalProcess(proc.pid, proc)

    def renew(self, name: str) -> bool:
        return False        # a process of this machine: its replacement is one too

    def gone(self, name: str) -> Optional[str]:
        return None         # this machine is always there

    def describe(self) -> Optional[dict[str, Any]]:
        return None

    def close(self) -> None:
        pass
