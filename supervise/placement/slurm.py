"""``rpcps up --slurm``: the members as job steps of the Slurm allocation ``rpcps up`` runs in
(a batch script's, or ``salloc``'s), one ``srun`` per member, supervised as ``rpcps up``
supervises processes.

Placement: member i of the plan (the leader first, then the other servers, the trainers, the
serving members) on node i mod N, counting the N nodes of the allocation from the one ``up``
runs on (the batch node, where the leader's store port is chosen), then in Slurm's order. Each
sidecar binds every interface, at ``--sidecar-port`` (8080 unless told) plus the count of the
members placed on its node before it, so one member per node is at 8080 on each.

Signals: ``srun`` turns a SIGTERM into killing its step, so a member is asked to stop with
``scancel --signal=TERM`` on its step (found by the step's name, the member's), which gives the
member the signal itself; ``kill()`` cancels the step.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from supervise.hosts.network import Unavailable
from supervise.placement import Placed
from supervise.processes import spawn_logged

SIDECAR_PORT = 8080


def _run(argv: list[str]) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise Unavailable(f"{' '.join(argv)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def job_alive(job: str) -> bool:
    """Whether Slurm job ``job`` is still queued or running; True when ``squeue`` cannot say (not
    on PATH, or the controller does not answer), so its members are asked rather than given up."""
    try:
        r = subprocess.run(["squeue", "-h", "--jobs", job, "--format", "%T"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if r.returncode != 0:
        return "Invalid job id" not in r.stderr      # forgotten by the controller: long over
    return any(state not in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")
               for state in r.stdout.split())


def _unusable(state: str) -> bool:
    """A node state (``sinfo``'s short form) no step can start in: down, failed, or not
    responding (a ``*`` after the state)."""
    return state.endswith("*") or state.rstrip("*~#!%$@^-").startswith(("down", "fail"))


class SlurmStep(Placed):
    """A member as step of job ``job``, named after the member; ``proc`` is its ``srun``. Signals go
    to the step through the controller (``scancel``), which delivers them to the member itself."""

    kind = "slurm"

    def __init__(self, pid: int, job: str, name: str, node: str, proc: Optional[subprocess.Popen] = None) -> None:
        super().__init__(pid, proc)
        self.job, self.step_name, self.node = job, name, node
        self._step: Optional[str] = None

    @classmethod
    def found(cls, described: dict[str, Any]) -> "SlurmStep":
        return cls(int(described["pid"]), described["job"], described["name"], described["node"])

    def step(self) -> Optional[str]:
        """``JOB.STEP`` of this member's step, once the controller lists it."""
        if self._step is None:
            r = subprocess.run(["squeue", "-h", "--steps", "--jobs", self.job, "--format", "%i %j"],
                               capture_output=True, text=True, timeout=30)
            mine = [line.split()[0] for line in r.stdout.splitlines() if line.split()[1:] == [self.step_name]]
            # The newest of the member's steps: a restarted member's old one may still be listed.
            self._step = max(mine, key=lambda step: int(step.rpartition(".")[2])) if mine else None
        return self._step

    def poll(self) -> Optional[int]:
        if self.proc is None:       # found elsewhere: its srun may run on another node
            return None if job_alive(self.job) and self.step() is not None else -1
        return super().poll()

    def send_signal(self, sig: int) -> None:
        step = self.step() if self.poll() is None else None
        if step is None:            # not started, or over: srun alone
            if self.proc is not None:
                self.proc.send_signal(sig)
            return
        subprocess.run(["scancel", "--quiet", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", step],
                       capture_output=True, timeout=30)

    def kill(self) -> None:
        step = self.step() if self.poll() is None else None
        if step is not None:
            subprocess.run(["scancel", "--quiet", step], capture_output=True, timeout=30)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def where(self) -> str:
        return f"as a step of Slurm job {self.job} on node {self.node}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "job": self.job, "name": self.step_name, "node": self.node}


class OnSlurm:
    """Every member a step of this Slurm job, on a node of the allocation (see the module)."""

    handle = SlurmStep

    @classmethod
    def from_settings(cls, cfg: Any) -> "OnSlurm":
        return cls(cfg.sidecar_port)

    @staticmethod
    def run_ended(state: dict[str, Any]) -> bool:
        """``rpcps up`` ran on the batch node, where its process id means nothing here: the run is
        over once Slurm says its job is."""
        hosts = state.get("hosts")
        jobs = {h["job"] for h in hosts.values() if isinstance(h, dict) and h.get("job")} if isinstance(hosts, dict) \
            else set()
        return bool(jobs) and not any(job_alive(str(job)) for job in jobs)

    def __init__(self, sidecar_port: int = 0, environ: Mapping[str, str] = os.environ) -> None:
        self._environ = environ
        self._base = sidecar_port or SIDECAR_PORT
        self.job = ""
        self.nodes: dict[str, str] = {}       # member -> its node
        self.ports: dict[str, int] = {}
        self._allocated: list[str] = []         # the allocation's nodes, the batch node first
        self._leader = ""
        self._suspect: set[str] = set()         # nodes a member was fenced on

    def create(self, names: list[str]) -> None:
        job, listed = self._environ.get("SLURM_JOB_ID"), self._environ.get("SLURM_JOB_NODELIST")
        if not job or not listed:
            raise Unavailable("runs inside a Slurm allocation (a batch script, or salloc): SLURM_JOB_ID and "
                              "SLURM_JOB_NODELIST are not set")
        absent = [tool for tool in ("srun", "scontrol", "squeue", "scancel") if shutil.which(tool) is None]
        if absent:
            raise Unavailable(f"Slurm's commands are not on PATH: {', '.join(absent)}")
        allocated = _run(["scontrol", "show", "hostnames", listed]).split()
        here = self._environ.get("SLURMD_NODENAME") or socket.gethostname()
        nodes = [here] + [n for n in allocated if n != here] if here in allocated else allocated
        self.job, self._allocated, self._leader = job, nodes, names[0] if names else ""
        on_node: dict[str, int] = {}
        for i, name in enumerate(names):
            node = nodes[i % len(nodes)]
            self.nodes[name] = node
            self.ports[name] = self._base + on_node.get(node, 0)
            on_node[node] = on_node.get(node, 0) + 1

    def add(self, name: str) -> None:
        """Placed by the same rule: the next node of the allocation in turn."""
        node = self._allocated[len(self.nodes) % len(self._allocated)]
        taken = {self.ports[m] for m, at in self.nodes.items() if at == node}
        self.nodes[name] = node
        # the first port free on that node: a member removed there may have left a gap below another's
        self.ports[name] = next(p for p in itertools.count(self._base) if p not in taken)

    def remove(self, name: str) -> None:
        """Its job step ended with it: only its place is given back."""
        self.nodes.pop(name, None)
        self.ports.pop(name, None)

    def master_addr(self, leader: str) -> str:
        return self.nodes[leader]

    def sidecar_host(self, name: str) -> str:
        return "0.0.0.0"

    def sidecar_port(self, name: str) -> int:
        return self.ports[name]

    def reach(self, name: str) -> str:
        return self.nodes[name]

    def spawn(self, name: str, argv: list[str], log_path: Path, env: dict) -> SlurmStep:
        # --overlap: a member may share its node's CPUs with another step (two members on a node,
        # or a restarted member while its old step is still being cleaned up).
        srun = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={self.nodes[name]}", "--overlap",
                f"--job-name={name}", "--kill-on-bad-exit=0", "--quiet",
                sys.executable, "-m", "supervise.cli", *argv]
        proc = spawn_logged(srun, log_path, {**env, "RPCPS_REQUEUE_JOB": self.job})
        return SlurmStep(proc.pid, self.job, name, self.nodes[name], proc)

    def renew(self, name: str) -> bool:
        """A fenced member's next start on another node of the allocation (its own may be lost,
        and no node a member was fenced on is chosen while another is left), the one with the
        fewest members, at the first port free there. Not the leader: its store's port was found
        free on the batch node, where it stays."""
        if name == self._leader:
            return False
        self._suspect.add(self.nodes[name])
        usable = self._usable()
        others = [n for n in usable if n not in self._suspect] or [n for n in usable if n != self.nodes[name]]
        if not others:
            return False
        count = {n: sum(1 for m, at in self.nodes.items() if at == n and m != name) for n in others}
        node = min(others, key=lambda n: count[n])
        taken = {self.ports[m] for m, at in self.nodes.items() if at == node and m != name}
        self.nodes[name] = node
        self.ports[name] = next(port for port in range(self._base, self._base + len(self.nodes) + 1)
                                if port not in taken)
        return True

    def gone(self, name: str) -> Optional[str]:
        """Why ``name``'s node can no longer take it (None: it can). A job that outlives a node's
        failure (``--no-kill``) loses the node from its allocation once Slurm sets it DOWN; a
        step started there is refused, so a member that died on it starts on another node."""
        node = self.nodes[name]
        if name == self._leader or node in self._usable():
            return None
        return f"its node {node} is no longer in Slurm job {self.job}'s allocation, or is not responding"

    def _usable(self) -> list[str]:
        """The allocation's nodes a step can start on now: still the job's and responding. When
        Slurm cannot say, every node of the allocation."""
        try:
            listed = _run(["squeue", "-h", "--jobs", self.job, "--format", "%N"]).strip()
            if not listed:
                return list(self._allocated)
            current = set(_run(["scontrol", "show", "hostnames", listed]).split())
            states = dict(line.split()[:2] for line in _run(
                ["sinfo", "-h", "-N", "--nodes", ",".join(self._allocated), "--format", "%N %t"]).splitlines()
                if len(line.split()) >= 2)
        except (Unavailable, OSError, subprocess.TimeoutExpired):
            return list(self._allocated)
        return [n for n in self._allocated if n in current and not _unusable(states.get(n, ""))]

    def describe(self) -> Optional[dict[str, Any]]:
        return {name: {"node": node, "job": self.job} for name, node in self.nodes.items()}

    def close(self) -> None:
        pass
