"""Where ``rpcps up`` runs its members: as processes of this machine (``Local``), each on an
emulated host of its own (``OnHosts``, ``--emulate-hosts``), or as steps of a Slurm job
(``services/slurm.py``'s ``OnSlurm``, ``--slurm``). The roster asks its placement for the
leader's address, each sidecar's address and port, and a started process; nothing else differs."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Optional

from services.processes import free_port, spawn_role


class _PortsInOrder:
    """Sidecar ports as ``--sidecar-port`` says: from the first, one per member in plan order;
    unset (0), a free port of this machine each."""

    def __init__(self, first_port: int) -> None:
        self._first_port = first_port
        self._order: dict[str, int] = {}

    def _number(self, names: list[str]) -> None:
        self._order = {name: i for i, name in enumerate(names)}

    def sidecar_port(self, name: str) -> int:
        return self._first_port + self._order[name] if self._first_port else free_port()


class Local(_PortsInOrder):
    """Every member a process of this machine, its sidecar at ``--sidecar-host``."""

    def __init__(self, master_addr: str, sidecar_host: str, first_port: int = 0) -> None:
        super().__init__(first_port)
        self._master_addr, self._sidecar_host = master_addr, sidecar_host

    def create(self, names: list[str]) -> None:
        self._number(names)

    def master_addr(self, leader: str) -> str:
        return self._master_addr

    def sidecar_host(self, name: str) -> str:
        return self._sidecar_host

    def reach(self, name: str) -> str:
        """The address this machine reaches member ``name``'s sidecar at."""
        return "127.0.0.1" if self._sidecar_host in ("0.0.0.0", "") else self._sidecar_host

    def spawn(self, name: str, argv: list[str], log_path: Path, env: dict) -> subprocess.Popen:
        return spawn_role("services.cli", argv, log_path, env)

    def describe(self) -> Optional[dict[str, Any]]:
        return None

    def close(self) -> None:
        pass


class OnHosts(_PortsInOrder):
    """Every member on an emulated host of its own (``services/hosts/``), made when the members
    are planned and removed when the run ends: the leader's store and every sidecar at its host's
    address, which this machine reaches over the hosts' bridge."""

    def __init__(self, cpus: Optional[float], rate: Optional[str], first_port: int = 0) -> None:
        super().__init__(first_port)
        self.cpus, self.rate = cpus, rate
        self.hosts = None

    def create(self, names: list[str]) -> None:
        from services.hosts.emulated import EmulatedHosts
        self._number(names)
        self.hosts = EmulatedHosts(names, self.cpus, self.rate).create()

    def master_addr(self, leader: str) -> str:
        return self.hosts.address(leader)

    def sidecar_host(self, name: str) -> str:
        return self.hosts.address(name)

    def reach(self, name: str) -> str:
        return self.hosts.address(name)

    def spawn(self, name: str, argv: list[str], log_path: Path, env: dict) -> subprocess.Popen:
        return self.hosts.python(name, "services.cli", argv, log_path, env)

    def describe(self) -> Optional[dict[str, Any]]:
        return self.hosts.describe() if self.hosts is not None else None

    def close(self) -> None:
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None
