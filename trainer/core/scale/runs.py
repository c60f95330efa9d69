"""One run of ``rpcps bench scale``: ``rpcps up --emulate-hosts`` to its end, and what each host
did while every trainer trained past its warm-up (CPU, throttled periods, bytes on its link);
or one process (``rpcps up --local``) on one host of the same share, the baseline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from services.client import SidecarClient, SidecarError
from supervise.hosts.emulated import EmulatedHosts, usage_of
from supervise.hosts.network import host_child
from supervise.hosts.quota import CpuQuota

POLL = 0.5              # seconds between looks at the trainers' steps and the hosts' counters
RUN_TIMEOUT = 1800.0


@dataclass
class Plan:
    """What every run of a bench shares."""

    cpus: float                  # each host's cores
    steps: int                   # per trainer
    warmup: int                  # first steps of each trainer left out
    client_role: str = "trainer"
    unit: str = "samples"        # what the trainers count (``timed`` in their status)
    flags: tuple[str, ...] = ()  # the case's, and what its ``prepare`` added
    cwd: Optional[Path] = None


@dataclass
class Window:
    """Each host's counters when every trainer had passed its warm-up, and the last time all were
    still training."""

    first: Optional[tuple[float, dict[str, dict], int]] = None
    last: Optional[tuple[float, dict[str, dict], int]] = None
    over: bool = False            # a trainer has taken its last step

    def seen(self, at: float, usage: dict[str, dict], units: int) -> None:
        """``units``: what the trainers had trained past their warm-ups, together, by ``at``."""
        if self.first is None:
            self.first = (at, usage, units)
        self.last = (at, usage, units)

    def per_s(self) -> Optional[float]:
        """The trainers' units a second while all of them trained: the steady state, which a short
        run's staggered starts and ends would blur."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[2] - self.first[2]) / (self.last[0] - self.first[0])

    def hosts(self, roles: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Per host: cores used (and by which of its member's threads), the share of its quota's
        periods throttled, its link's bytes a second."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return {}
        (t0, a, _), (t1, b, _) = self.first, self.last
        out = {}
        for name in b:
            d = {k: b[name][k] - a[name].get(k, 0.0) for k in b[name] if k != "threads"}
            threads = {k: (v - a[name]["threads"].get(k, 0.0)) / (t1 - t0) for k, v in b[name]["threads"].items()}
            out[name] = {"role": roles.get(name), "cores": d["cpu_s"] / (t1 - t0),
                         "throttled": d["throttled"] / d["periods"] if d["periods"] else 0.0,
                         "link_bytes_per_s": (d["rx"] + d["tx"]) / (t1 - t0),
                         "link_rx_bytes_per_s": d["rx"] / (t1 - t0), "link_tx_bytes_per_s": d["tx"] / (t1 - t0),
                         "threads": dict(sorted(((k, round(v, 4)) for k, v in threads.items() if v > 0.001),
                                                key=lambda kv: -kv[1]))}
        return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds the member started as ``pid`` (by ``HostProcess``: its one child) has used, by
    thread name (TensorPipe's, the autograd engine's, Python's own): where a host's cores went."""
    member = host_child(pid)
    if member is None:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{member}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue                  # a thread that ended
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rpartition(")")[2].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _status(url: str) -> dict[str, Any]:
    try:
        with SidecarClient(url, timeout=2.0) as client:
            return client.status()
    except (httpx.HTTPError, SidecarError, ValueError):       # starting, or stopping: not this time
        return {}


def _ready(url: str) -> bool:
    with SidecarClient(url, timeout=2.0) as client:
        return client.ready()


def cluster(plan: Plan, trainers: int, servers: int, rate: Optional[str] = None, extra: tuple[str, ...] = (),
            serving: Optional[tuple[str, Callable[[str], Any]]] = None) -> dict[str, Any]:
    """``rpcps up`` with ``trainers`` and ``servers`` hosts (and whatever ``extra`` adds): its
    ``done`` event, and each host's figures while every trainer trained. ``serving``: a role, and
    what to call with its member's URL once it is ready (returning an object whose ``stop()``
    gives its figures)."""
    with tempfile.TemporaryDirectory(prefix="rpcps-scale-") as tmp:
        state = Path(tmp) / "state"
        argv = [sys.executable, "-m", "supervise.cli", "up", "--json", "--emulate-hosts", "--host-cpus", str(plan.cpus),
                "--num-ps", str(servers), "--num-trainers", str(trainers), "--steps", str(plan.steps),
                "--warmup-steps", str(plan.warmup), "--state-dir", str(state), "--checkpoint-dir", str(Path(tmp) / "ck"),
                "--no-final-checkpoint", "--progress-interval", "60", *plan.flags, *extra]
        if rate is not None:
            argv += ["--link-rate", rate]
        out = Path(tmp) / "out.jsonl"
        window, load, served = Window(), None, None
        with open(out, "w") as f, open(Path(tmp) / "err.log", "w") as err:
            proc = subprocess.Popen(argv, stdout=f, stderr=err, text=True, cwd=plan.cwd)
            try:
                deadline = time.monotonic() + RUN_TIMEOUT
                state_seen: dict[str, Any] = {}
                while proc.poll() is None and time.monotonic() < deadline:
                    state_seen = _look(state, plan, window, state_seen)
                    if serving is not None and load is None and state_seen and not window.over:
                        role, begin = serving
                        url = next((u for n, u in state_seen["sidecars"].items()
                                    if state_seen["roles"].get(n) == role), None)
                        if url is not None and _ready(url):
                            load = begin(url)
                    if load is not None and served is None and window.over:
                        served = load.stop()      # beside training only: not while the cluster stops
                    time.sleep(POLL)  # noqa: sleep-ok (sampling the hosts while the run goes on)
            finally:
                if load is not None and served is None:
                    served = load.stop()
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(60)
        events = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
        done = [e for e in events if e.get("event") == "done"]
        if proc.returncode != 0 or not done:
            raise RuntimeError(f"rpcps up failed ({proc.returncode}): {out.read_text()[-1500:]}"
                               f"{(Path(tmp) / 'err.log').read_text()[-1500:]}")
        return {"done": done[-1], "hosts": window.hosts(state_seen.get("roles", {})), "served": served,
                "window_per_s": window.per_s()}


def _look(state: Path, plan: Plan, window: Window, seen: dict[str, Any]) -> dict[str, Any]:
    """One look: the hosts' counters, kept while every trainer is past its warm-up and none done."""
    try:
        cluster_state = json.loads((state / "cluster.json").read_text())
    except (OSError, ValueError):
        return seen
    if "hosts" not in cluster_state:
        return seen
    roles, sidecars = cluster_state["roles"], cluster_state["sidecars"]
    statuses = [_status(u) for n, u in sidecars.items() if roles.get(n) == plan.client_role]
    steps = [st.get("step") for st in statuses]
    window.over = window.over or bool(steps) and any(s is not None and s >= plan.steps for s in steps)
    if steps and all(s is not None and plan.warmup < s < plan.steps for s in steps):
        at = time.monotonic()
        units = sum((st.get("timed") or {}).get(plan.unit) or 0 for st in statuses)
        try:
            window.seen(at, {n: {**usage_of(h), "threads": thread_cpu(cluster_state["pids"][n])}
                             for n, h in cluster_state["hosts"].items()}, units)
        except (OSError, subprocess.CalledProcessError, ValueError):
            pass                   # a host going away: the run is ending
    return cluster_state


def one_process(plan: Plan, trainers: int = 1, on_host: bool = True) -> dict[str, Any]:
    """``rpcps up --local`` (the same model and data in one process, each step on ``trainers``
    trainers' samples): on one host of the plan's share (the baseline), or (``on_host`` False) as
    a plain process of this machine (the exact reference of a sync run, where only its result counts)."""
    with tempfile.TemporaryDirectory(prefix="rpcps-scale-") as tmp:
        argv = [sys.executable, "-m", "supervise.cli", "up", "--json", "--local", "--num-trainers", str(trainers),
                "--steps", str(plan.steps), "--warmup-steps", str(plan.warmup), "--state-dir", str(Path(tmp) / "state"),
                "--progress-interval", "60", *plan.flags]
        log = Path(tmp) / "out.log"
        hosts = EmulatedHosts(["one"], plan.cpus).create() if on_host else None
        try:
            if hosts is not None:
                proc = hosts.spawn("one", argv, log, cwd=plan.cwd)
            else:
                with open(log, "ab") as f:
                    proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=plan.cwd)
            try:
                proc.wait(RUN_TIMEOUT)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            used = hosts.usage("one") if hosts is not None else None
        finally:
            if hosts is not None:
                hosts.close()
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"event": "done"')]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"rpcps up --local failed ({proc.returncode}): {log.read_text()[-2000:]}")
        host = None
        if used is not None:
            host = {"cpu_s": used["cpu_s"], "throttled": used["throttled"] / used["periods"] if used["periods"] else 0.0}
        return {"done": lines[-1], "host": host}


class Load:
    """A client of a serving member, at its peak: ``concurrency`` requests of ``size`` rows always
    in flight, from a process of this machine held to ``cpus`` cores of its own (so it cannot take
    the hosts' cores). ``stop()`` ends it and gives its rows/s, latency and refusals."""

    def __init__(self, rows: list[dict], cpus: float, concurrency: int = 4, size: int = 32) -> None:
        self.rows, self.cpus, self.concurrency, self.size = rows, cpus, concurrency, size

    def start(self, url: str) -> "Load":
        self._folder = tempfile.TemporaryDirectory(prefix="rpcps-load-")
        folder = Path(self._folder.name)
        (folder / "rows.json").write_text(json.dumps(self.rows))
        self._stop = folder / "stop"
        self._quota = CpuQuota(f"rpcps-load-{os.getpid() % 100000}", self.cpus).create()
        self._proc = subprocess.Popen(self._quota.prefix() + [
            sys.executable, "-m", "trainer.core.scale.bench_load", url, str(folder / "rows.json"),
            str(self.concurrency), str(self.size), str(self._stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        return self

    def stop(self) -> dict[str, Any]:
        try:
            self._stop.write_text("")
            out, err = self._proc.communicate(timeout=60)
            if self._proc.returncode != 0:
                return {"error": err[-1000:]}
            return json.loads(out.strip().splitlines()[-1])
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._quota.remove()
            self._folder.cleanup()
