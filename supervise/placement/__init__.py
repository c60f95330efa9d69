"""Where ``rpcps up`` runs its members, and the one handle everything acts on them through.

A placement (``Local``: processes of this machine; ``OnHosts``: ``--emulate-hosts``, a host of its
own each; ``OnSlurm``: ``--slurm``, a step each of the job's allocation) plans where each member
runs, says the addresses the others reach it at, and starts it. What it starts is a ``Placed``:
the supervisor polls and stops it, fencing kills it, and ``rpcps chaos``, in a process of its own,
finds it from what it describes in ``cluster.json`` (``found``) to kill, freeze or cut it off.
Nothing outside this package knows how a member runs: a process id here, a PID namespace on a
host, a job step on a node. ``PLACEMENTS`` names each placement: ``rpcps up --run-on`` chooses one
by its name, and a recorded handle is found again by its ``kind``, the same name. A Kubernetes
placement would be one more entry and module, not a fake process.
"""
from __future__ import annotations

import abc
import importlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, ClassVar, Optional, Protocol


class NotPossible(RuntimeError):
    """What was asked of a member cannot be done where it runs (a partition of a local process)."""


class Placed(abc.ABC):
    """One start of a member, where its placement put it.

    ``proc`` is the process of this machine that stands for the member (the member itself, the
    ``unshare`` of its host, the ``srun`` of its step): it gives the exit code. A handle made by
    ``found`` in another process has none, and ``poll`` says only whether the member runs."""

    kind: ClassVar[str]
    cuttable: ClassVar[bool] = False    # whether ``connect`` can cut it off (its host's link is the placement's)

    def __init__(self, pid: int, proc: Optional[subprocess.Popen] = None) -> None:
        self.pid, self.proc = pid, proc

    def poll(self) -> Optional[int]:
        """None while it runs; else its exit code (-1 when only its absence is known)."""
        if self.proc is not None:
            return self.proc.poll()
        return None if alive(self.pid) else -1

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.proc is None:
            raise NotPossible("a member found from cluster.json cannot be waited for")
        return self.proc.wait(timeout)

    @abc.abstractmethod
    def send_signal(self, sig: int) -> None:
        """``sig`` to the member itself, wherever it runs (SIGSTOP freezes it, SIGCONT continues it)."""

    def kill(self) -> None:
        """The member ended at once, a frozen one too; what stands for it here with it."""
        self.send_signal(signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def connect(self, up: bool) -> None:
        """Cut the member off from the network (``up`` False), its process running on, or bring it
        back: only where its host's link is the placement's to cut."""
        raise NotPossible(f"a partition needs members on hosts of their own (rpcps up --emulate-hosts); this "
                          f"member runs {self.where()}")

    @abc.abstractmethod
    def where(self) -> str:
        """Where it runs, in words."""

    def describe(self) -> dict[str, Any]:
        """What another process needs to find it again (``found``): ``cluster.json``'s record."""
        return {"kind": self.kind, "pid": self.pid}


class Placement(Protocol):
    """Where a run's members go. ``create`` once with every member's name, before any starts.
    ``handle`` is the class of what it starts, whose ``kind`` is the placement's name."""

    handle: ClassVar[type[Placed]]

    @classmethod
    def from_settings(cls, cfg: Any) -> "Placement":
        """The placement ``rpcps up``'s settings describe (``--sidecar-port``, ``--host-cpus`` ...)."""

    @staticmethod
    def run_ended(state: dict[str, Any]) -> bool:
        """Whether the run that wrote ``state`` (its ``cluster.json``) has ended, asked where the
        placement ran it: ``rpcps status`` and ``chaos`` refuse a run that is over."""

    def create(self, names: list[str]) -> None: ...

    def add(self, name: str) -> None:
        """One more member, ``name``, while the run goes on: placed as ``create`` places each."""

    def remove(self, name: str) -> None:
        """Member ``name`` stopped for good (it exited, wanted no more): what ``add`` or ``create``
        made for it given back (its emulated host), so that a member of that name can be added
        again."""

    def master_addr(self, leader: str) -> str: ...
    def sidecar_host(self, name: str) -> str: ...
    def sidecar_port(self, name: str) -> int: ...
    def reach(self, name: str) -> str: ...

    def spawn(self, name: str, argv: list[str], log_path: Path, env: dict) -> Placed:
        """Start ``python -m supervise.cli argv`` as member ``name``, output appended to ``log_path``."""

    def renew(self, name: str) -> bool:
        """Member ``name`` was fenced, and its old place may be cut off: place its next start
        afresh where the placement can (a fresh host). True when its addresses changed."""

    def gone(self, name: str) -> Optional[str]:
        """Why member ``name``, which died, cannot start again where it ran (its Slurm node left
        the allocation), so that its next start is placed afresh (``renew``); None: it can."""

    def describe(self) -> Optional[dict[str, Any]]: ...
    def close(self) -> None: ...


# Every placement, by its name: what ``rpcps up --run-on`` takes and what ``cluster.json``
# records of each member's handle (its ``kind``). A new one (Kubernetes) is one more line here and
# one more module beside these, imported when chosen.
PLACEMENTS: dict[str, str] = {
    "local": "supervise.placement.local:Local",          # processes of this machine (the default)
    "hosts": "supervise.placement.hosts:OnHosts",        # an emulated host each (--emulate-hosts)
    "slurm": "supervise.placement.slurm:OnSlurm",        # a step each of a Slurm allocation (--slurm)
}


def placement_class(name: str) -> Any:
    """The placement registered as ``name``."""
    if name not in PLACEMENTS:
        raise NotPossible(f"no placement is named {name!r}; one of {', '.join(PLACEMENTS)}")
    module, _, attr = PLACEMENTS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def placement_for(cfg: Any) -> Placement:
    """The placement ``rpcps up``'s settings choose (``--run-on``)."""
    return placement_class(cfg.run_on).from_settings(cfg)


def placed_of(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each member of a run, by the record its placement keeps of its handle (``cluster.json``'s
    ``placed``): a new start of a member is a new record (a process, a Slurm step, on a host),
    whatever the placement. A ``cluster.json`` of an older ``rpcps up`` records only process ids:
    local processes."""
    return state.get("placed") or {n: {"kind": "local", "pid": p} for n, p in (state.get("pids") or {}).items()}


def found(described: dict[str, Any]) -> Placed:
    """The handle ``describe`` recorded, in another process (``rpcps chaos``, ``status``); a
    record without a kind (``cluster.json`` of an older ``rpcps up``) is a local process."""
    kind = described.get("kind", "local")
    if kind not in PLACEMENTS:
        raise NotPossible(f"cluster.json names a placement this rpcps does not know: {kind!r}")
    return placement_class(kind).handle.found(described)


def launcher_ended(state: dict[str, Any]) -> bool:
    """For a run whose ``rpcps up`` is a process of this machine: whether it has ended (a record of
    an older ``rpcps up``, without its process id: whether every member has)."""
    pid = state.get("launcher_pid")
    if isinstance(pid, int):
        return not alive(pid)
    pids = state.get("pids") or {}
    return bool(pids) and not any(alive(p) for p in pids.values() if isinstance(p, int))


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
