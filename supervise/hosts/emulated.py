"""Members as hosts: every process on an emulated host of its own (``network.py``) with its own
share of the CPU (``quota.py``) and, optionally, a capped link. The one layer ``rpcps up
--emulate-hosts``, ``rpcps bench scale`` and the suite start hosts through."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import Field, field_validator

from services.config import ConfigBase
from supervise.hosts.network import HostNetwork, HostProcess, link_counters, remove
from supervise.hosts.quota import CGROUP, CpuQuota
from supervise.processes import spawn_logged

RATE = r"^[0-9]+(\.[0-9]+)?[kmg]?bit$"


class HostsSettings(ConfigBase):
    """How ``rpcps up`` places its members (root only): each on an emulated host of its own."""

    emulate_hosts: bool = Field(False, description="run every member on an emulated host of its own: a network "
                                                   "namespace with its own address, PID and UTS namespaces, and "
                                                   "--host-cpus cores (needs root)")
    host_cpus: Optional[float] = Field(None, gt=0, description="cores each emulated host may use (a CFS quota; "
                                                                "default: no limit); torch threads follow it")
    link_rate: Optional[str] = Field(None, pattern=RATE, description="each emulated host's link out, in tc's units "
                                                                     "(1gbit, 100mbit; default: unlimited)")

    @field_validator("host_cpus")
    @classmethod
    def _within_machine(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and v > (os.cpu_count() or 1):
            raise ValueError(f"more cores than this machine has ({os.cpu_count()})")
        return v


def threads_for(cpus: Optional[float]) -> int:
    """torch's threads on a host of ``cpus`` cores: torch ignores CFS quotas and would start one
    thread per core of the machine, each throttled in turn."""
    return max(1, math.floor(cpus)) if cpus is not None else (os.cpu_count() or 1)


class EmulatedHosts:
    def __init__(self, names: list[str], cpus: Optional[float] = None, rate: Optional[str] = None,
                 tag: Optional[str] = None) -> None:
        self.net = HostNetwork(names, tag)
        self.cpus, self.rate = cpus, rate
        self.quotas = {n: CpuQuota(self.net.namespace(n), cpus) for n in names}

    @property
    def names(self) -> list[str]:
        return list(self.net.addresses)

    def create(self) -> "EmulatedHosts":
        self.net.create()
        try:
            for name, quota in self.quotas.items():
                quota.create()
                self.net.limit(name, self.rate)
        except BaseException:
            self.close()
            raise
        return self

    def add(self, name: str) -> str:
        """One more host, made as the first were, while they run; its address."""
        address = self.net.add(name)
        self.quotas[name] = quota = CpuQuota(self.net.namespace(name), self.cpus)
        quota.create()
        self.net.limit(name, self.rate)
        return address

    def remove(self, name: str) -> None:
        """Host ``name`` removed while the others run: what still runs in it ended, its CPU group,
        namespace and link removed."""
        self.quotas.pop(name).remove()
        self.net.remove_host(name)

    def address(self, name: str) -> str:
        return self.net.addresses[name]

    @property
    def threads(self) -> int:
        return threads_for(self.cpus)

    def environ(self) -> dict[str, str]:
        """What every process on a host is told: its threads, and that its interface is ``eth0``."""
        n = str(self.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TP_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}

    def argv(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` on host ``name``, inside its CPU quota; start it with ``HostProcess``."""
        return self.quotas[name].prefix() + self.net.exec_argv(name, argv)

    def spawn(self, name: str, argv: list[str], log_path: Path, env: Optional[dict] = None,
              cwd: Optional[Path] = None) -> HostProcess:
        """``argv`` started on host ``name`` in a session of its own, output appended to ``log_path``."""
        return spawn_logged(self.argv(name, argv), log_path, {**self.environ(), **(env or {})}, HostProcess, cwd)

    def python(self, name: str, module: str, argv: list[str], log_path: Path, env: Optional[dict] = None,
               cwd: Optional[Path] = None) -> HostProcess:
        return self.spawn(name, [sys.executable, "-m", module, *argv], log_path, env, cwd)

    def usage(self, name: str) -> dict[str, float]:
        """Host ``name``'s CPU seconds and throttled periods, and its link's bytes in and out."""
        return {**self.quotas[name].usage(), **self.net.counters(name)}

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each host as ``cluster.json`` records it (what ``usage_of`` reads back)."""
        return {n: self.describe_one(n) for n in self.names}

    def describe_one(self, name: str) -> dict[str, Any]:
        return {"address": self.address(name), "namespace": self.net.namespace(name), "cpus": self.cpus,
                "link_rate": self.rate, "threads": self.threads}

    def close(self) -> None:
        """Every process left on the hosts ended, every group, namespace and link removed."""
        for quota in self.quotas.values():
            quota.remove()
        self.net.close()


def usage_of(described: dict[str, Any]) -> dict[str, float]:
    """A host's usage from its ``describe()`` entry, by a process that did not make it."""
    ns = described["namespace"]
    return {**CpuQuota(ns, described.get("cpus")).usage(), **link_counters(ns)}


def remove_all(tag: str) -> None:
    """Whatever hosts made under ``tag`` (a process id, by default) left behind: a launcher killed
    outright cannot remove its own. Ends the processes still in their groups first."""
    prefix = f"rpcps{tag}-"
    for group in sorted({p.name for c in ("cpu", "cpuacct") for p in (CGROUP / c).glob(f"{prefix}*")}):
        CpuQuota(group, None).remove()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    network = HostNetwork([], tag)
    remove([n for n in listed if n.startswith(prefix) or n == network.switch], network.uplink)
