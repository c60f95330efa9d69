"""A real Slurm cluster on this machine (Debian's slurm-wlm and munge): a controller and one
``slurmd`` per node, each on an emulated host of its own (``supervise/hosts/``: its own network,
PID and UTS namespaces and CPU quota), as on separate machines. Debian's ``slurmd`` cannot run
several daemons on one host, so each node needs a host. The controller's host is also the login
node: jobs are submitted, watched and cancelled from it, where every node's name resolves. The
folder it is made in is every node's shared storage (they share this machine's file system).
Everything it starts is ended and every host removed by ``close()``, even after a failure."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Optional

from supervise.hosts.emulated import EmulatedHosts
from supervise.processes import stop_in_waves
from tests.support.wait import wait_until

CONTROLLER = "slurmctl"
DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo")


def missing() -> Optional[str]:
    """Why a Slurm cluster cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "a Slurm cluster of emulated hosts needs root"
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return f"Slurm's and munge's programs are not installed (apt-get install slurm-wlm munge): {absent}"
    return None


class SlurmCluster:
    def __init__(self, folder: Path, nodes: int, cpus: Optional[float]) -> None:
        self.folder = folder
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.hosts = EmulatedHosts([CONTROLLER, *self.nodes], cpus)
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge" / "munge.socket"
        self._daemons: list[tuple[str, subprocess.Popen]] = []
        self._munged: Optional[int] = None

    # --- start ---------------------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        try:
            self.hosts.create()
            self.hosts.net.name_each_other()
            self._start_munge()
            self._write_conf()
            self._spawn(CONTROLLER, ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                self.boot(node)
            wait_until(self._idle, 60, f"the Slurm nodes {self.nodes} idle")
        except BaseException:
            self.close()
            raise
        return self

    def _start_munge(self) -> None:
        """munged with a key and socket of its own, so a machine's own munge is left alone. Every
        host reaches its socket through the shared file system."""
        folder = self.munge_socket.parent
        folder.mkdir(parents=True)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        pid_file = folder / "munged.pid"
        r = subprocess.run(["munged", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                            f"--pid-file={pid_file}", f"--log-file={folder / 'munged.log'}",
                            f"--seed-file={folder / 'munged.seed'}"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"munged did not start: {r.stderr.strip()}")
        self._munged = int(pid_file.read_text())

    def _write_conf(self) -> None:
        """Slurm's defaults but two, so that a test need not wait minutes: a node whose slurmd is
        silent for 10 s is set DOWN (``SlurmdTimeout``, 300 s by default), and a requeued job
        waits 20 s before it starts again (``cred_expire``, 120 s by default)."""
        state = self.folder / "state"
        for sub in ("ctld", "spool", "logs"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.hosts.address(n)} CPUs={cpus} State=UNKNOWN"
                          for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=rpcpstest
SlurmctldHost={CONTROLLER}({self.hosts.address(CONTROLLER)})
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=20
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state / 'ctld'}
SlurmdSpoolDir={state / 'spool'}/%n
SlurmctldPidFile={state / 'slurmctld.pid'}
SlurmdPidFile={state / 'slurmd'}-%n.pid
SlurmctldLogFile={state / 'logs' / 'slurmctld.log'}
SlurmdLogFile={state / 'logs'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=2
PropagateResourceLimits=NONE
KillWait=30
SlurmdTimeout=10
{nodes}
PartitionName=rpcps Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, host: str, argv: list[str]) -> None:
        log = self.folder / "state" / "logs" / f"{host}.out"
        self._daemons.append((host, self.hosts.spawn(host, argv, log, env=self.environ())))

    def environ(self) -> dict[str, str]:
        """What Slurm's commands and every job are given (jobs inherit the submitter's environment)."""
        return {"SLURM_CONF": str(self.conf)}

    def _idle(self) -> bool:
        for host, proc in self._daemons:
            if proc.poll() is not None:
                raise AssertionError(f"{host}'s Slurm daemon exited with {proc.returncode}:\n{self.logs()}")
        r = self.login(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values())

    # --- use -----------------------------------------------------------------------------------------
    def login(self, argv: list[str], cwd: Optional[Path] = None, env: Optional[dict] = None, check: bool = True,
              timeout: float = 60) -> subprocess.CompletedProcess:
        """``argv`` run on the login node (the controller's host), where the nodes' names resolve."""
        r = subprocess.run(self.hosts.net.exec_argv(CONTROLLER, argv), capture_output=True, text=True, cwd=cwd,
                           timeout=timeout, env={**os.environ, **self.environ(), **(env or {})})
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited with {r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, script: Path, args: list[str], cwd: Path, env: Optional[dict] = None) -> int:
        """``sbatch script args…`` from ``cwd`` on the login node; the job's id."""
        out = self.login(["sbatch", "--parsable", str(script), *args], cwd=cwd, env=env).stdout.strip()
        return int(out.split(";")[0])

    def state(self, job: int) -> str:
        """The job's state (PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, FAILED, …); without
        accounting, a job the controller has forgotten reads as GONE."""
        r = self.login(["scontrol", "show", "job", str(job)], check=False)
        m = re.search(r"JobState=(\S+)", r.stdout)
        return m.group(1) if m else "GONE"

    def wait_done(self, job: int, timeout: float) -> str:
        return wait_until(lambda: (s := self.state(job)) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
                          and s, timeout, f"Slurm job {job} to end")

    def hang(self, node: str, hung: bool = True) -> None:
        """``node``'s slurmd stopped (SIGSTOP), or continued: to the controller, a slurmd hung or
        killed, so it sets the node DOWN after ``SlurmdTimeout``, while what runs there lives on."""
        proc = next(p for host, p in self._daemons if host == node)
        proc.send_signal(signal.SIGSTOP if hung else signal.SIGCONT)

    def crash(self, node: str) -> None:
        """``node`` down at once, as a machine that loses power: its slurmd is its host's first
        process, and everything on the host ends with it."""
        next(p for host, p in self._daemons if host == node).kill()

    def boot(self, node: str) -> None:
        """``node``'s slurmd started again after a crash; it rejoins (``ReturnToService=2``)."""
        self._daemons = [(host, p) for host, p in self._daemons if host != node]
        self._spawn(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])

    def node_state(self, node: str) -> str:
        """``sinfo``'s short state of ``node`` (``idle``, ``mix``, ``down*``, …)."""
        return self.login(["sinfo", "-h", "-N", "--nodes", node, "-o", "%t"], check=False).stdout.strip()

    def logs(self) -> str:
        out = []
        for path in sorted((self.folder / "state" / "logs").glob("*")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)

    # --- stop ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Every job cancelled, the daemons stopped, munged ended and the hosts removed."""
        try:
            for host, proc in self._daemons:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)     # a hung one, to take its SIGTERM
            if any(proc.poll() is None for host, proc in self._daemons if host == CONTROLLER):
                self.login(["scancel", "--full", "--user", "root"], check=False, timeout=30)
            stop_in_waves([[(h, p) for h, p in self._daemons if h != CONTROLLER],
                           [(h, p) for h, p in self._daemons if h == CONTROLLER]], timeout=20.0)
        finally:
            self._daemons.clear()
            if self._munged is not None:
                try:
                    os.kill(self._munged, 15)
                except ProcessLookupError:
                    pass
                self._munged = None
            self.hosts.close()     # ends whatever a job left on a node

