"""``OnHosts`` (``rpcps up --emulate-hosts``): every member on an emulated host of its own
(``supervise/hosts/``), made when the members are planned and removed when the run ends; the
leader's store and every sidecar at its host's address, which this machine reaches over the
hosts' bridge. A member fenced (it stopped answering: frozen, or its host cut off) starts again
on a fresh host, as a cluster manager reschedules a pod off a node it lost: its old host may
still be cut off, and a replacement there would be too."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

from supervise.hosts.network import host_child, ip
from supervise.placement import Placed, launcher_ended
from supervise.placement.local import _PortsInOrder


class OnHost(Placed):
    """A member on an emulated host: ``pid`` is the ``unshare`` that holds its PID namespace, and
    the member is its one child (PID 1 there), which signals reach; ``connect`` is its host's link."""

    kind = "hosts"
    cuttable = True

    def __init__(self, pid: int, namespace: str, host: str, proc: Optional[subprocess.Popen] = None) -> None:
        super().__init__(pid, proc)
        self.namespace, self.host = namespace, host

    @classmethod
    def found(cls, described: dict[str, Any]) -> "OnHost":
        return cls(int(described["pid"]), described["namespace"], described["host"])

    def send_signal(self, sig: int) -> None:
        target = host_child(self.pid)
        try:
            os.kill(target if target is not None else self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        # unshare --kill-child ends the member with it; the member first, in case it is frozen
        # and unshare is not the one to end it.
        self.send_signal(signal.SIGKILL)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc is not None:
            self.proc.poll()

    def connect(self, up: bool) -> None:
        if up and not Path(f"/run/netns/{self.namespace}").exists():
            return      # its host is gone (the run that made it ended): no link is left to bring back
        ip("-n", self.namespace, "link", "set", "eth0", "up" if up else "down")

    def where(self) -> str:
        return f"on emulated host {self.host} ({self.namespace})"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "namespace": self.namespace, "host": self.host}


class OnHosts(_PortsInOrder):
    """Every member on an emulated host of its own (see the module)."""

    handle = OnHost

    run_ended = staticmethod(launcher_ended)

    @classmethod
    def from_settings(cls, cfg: Any) -> "OnHosts":
        return cls(cfg.host_cpus, cfg.link_rate, cfg.sidecar_port)

    def __init__(self, cpus: Optional[float], rate: Optional[str], first_port: int = 0) -> None:
        super().__init__(first_port)
        self.cpus, self.rate = cpus, rate
        self.hosts = None
        self.host_of: dict[str, str] = {}       # member -> the host it runs on now

    def create(self, names: list[str]) -> None:
        from supervise.hosts.emulated import EmulatedHosts
        self._number(names)
        self.hosts = EmulatedHosts(names, self.cpus, self.rate).create()
        self.host_of = {n: n for n in names}

    def add(self, name: str) -> None:
        super().add(name)
        self.hosts.add(name)
        self.host_of[name] = name

    def remove(self, name: str) -> None:
        """Its host, and any it was fenced off before, removed: a server added again later gets a
        fresh one of its name."""
        for host in self._hosts_of(name):
            self.hosts.remove(host)
        self.host_of.pop(name, None)

    def master_addr(self, leader: str) -> str:
        return self.reach(leader)

    def sidecar_host(self, name: str) -> str:
        return self.reach(name)

    def reach(self, name: str) -> str:
        return self.hosts.address(self.host_of[name])

    def spawn(self, name: str, argv: list[str], log_path: Path, env: dict) -> OnHost:
        host = self.host_of[name]
        proc = self.hosts.python(host, "supervise.cli", argv, log_path, env)
        return OnHost(proc.pid, self.hosts.net.namespace(host), host, proc)

    def renew(self, name: str) -> bool:
        """A fresh host for ``name``'s next start (``ps1-2``, ``ps1-3``, …); the old one stays, its
        processes ended, until the run ends."""
        host = f"{name}-{len(self._hosts_of(name)) + 1}"
        self.hosts.add(host)
        self.host_of[name] = host
        return True

    def _hosts_of(self, name: str) -> list[str]:
        """Every host ``name`` has run on in this run: its first, and those ``renew`` made."""
        return [h for h in self.hosts.names if h == name or h.startswith(f"{name}-")]

    def gone(self, name: str) -> Optional[str]:
        return None         # a host lost is found by the deadline, and renewed by fencing

    def describe(self) -> Optional[dict[str, Any]]:
        if self.hosts is None:
            return None
        return {name: {**self.hosts.describe_one(host), "host": host} for name, host in self.host_of.items()}

    def close(self) -> None:
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None
