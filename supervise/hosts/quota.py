"""A host's share of the machine's CPU: a cgroup v1 ``cpu`` group with a CFS quota (the machine
this was built on has no cgroup v2 ``cpu.max``), and a ``cpuacct`` group beside it that counts
what its processes used. A quota is exact only while it binds; under contention it is a ceiling.
So ``usage()`` reports throttled periods beside the CPU used: throttling is the proof that the
quota, not the shared machine, was the limit."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

from supervise.hosts.network import Unavailable

CGROUP = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuQuota:
    def __init__(self, name: str, cpus: Optional[float]) -> None:
        """``cpus``: cores the group may use per period (None: no limit, only counted)."""
        self.name, self.cpus = name, cpus
        self.cpu, self.acct = CGROUP / "cpu" / name, CGROUP / "cpuacct" / name

    def create(self) -> "CpuQuota":
        if not (CGROUP / "cpu" / "cpu.cfs_quota_us").exists() or not (CGROUP / "cpuacct" / "cpuacct.usage").exists():
            raise Unavailable("CPU quotas need cgroup v1's cpu and cpuacct controllers under /sys/fs/cgroup")
        try:
            for group in (self.cpu, self.acct):
                group.mkdir(exist_ok=True)
            (self.cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            quota = -1 if self.cpus is None else max(1000, round(self.cpus * PERIOD_US))
            (self.cpu / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as exc:
            self.remove()
            raise Unavailable(f"cannot make the cgroup {self.name}: {exc}") from None
        return self

    def prefix(self) -> list[str]:
        """An argv prefix that moves the process into both groups, then runs the rest in its place
        (its children inherit the groups)."""
        return ["sh", "-c", 'echo $$ > "$1" && echo $$ > "$2" && shift 2 && exec "$@"', "rpcps-quota",
                str(self.cpu / "cgroup.procs"), str(self.acct / "cgroup.procs")]

    def usage(self) -> dict[str, float]:
        """CPU seconds used, and the quota's periods: run, throttled, and the seconds throttled."""
        stat = dict(line.split() for line in (self.cpu / "cpu.stat").read_text().splitlines() if line.strip())
        return {"cpu_s": int((self.acct / "cpuacct.usage").read_text()) / 1e9,
                "periods": int(stat.get("nr_periods", 0)), "throttled": int(stat.get("nr_throttled", 0)),
                "throttled_s": int(stat.get("throttled_time", 0)) / 1e9}

    def remove(self, timeout: float = 10.0) -> None:
        """Ends whatever still runs in the group (only what was started in it), then removes it."""
        deadline = time.monotonic() + timeout
        for group in (self.cpu, self.acct):
            while group.exists():
                try:
                    pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    group.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)  # noqa: sleep-ok (a killed process leaves its group a moment later)
