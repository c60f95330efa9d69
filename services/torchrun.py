"""A role started by torchrun (``torchrun --nproc-per-node 2 -m trainer --num-ps 2 --ps-addr …``).

torchrun says which worker a process is (``RANK`` of ``WORLD_SIZE``, ``LOCAL_RANK`` on its node),
and its ``MASTER_ADDR``/``MASTER_PORT`` are the workers' own rendezvous, for their process group.
So such a role is named by its rank, counts its peers from the world size, offsets its sidecar
port by its local rank (two workers on a node cannot share one), and must be told where the
servers' store is (``--ps-addr``): it cannot be torchrun's.
"""
from __future__ import annotations

import datetime
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from services.config import CommonConfig, ConfigError, env_name
from services.workload import TorchrunSpec

if TYPE_CHECKING:     # imported where used: `rpcps --help` must not pay for torch
    import torch.distributed as dist

_SET_BY_TORCHRUN = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Worker:
    rank: int
    world_size: int
    local_rank: int


def worker(environ: Mapping[str, str]) -> Optional[Worker]:
    """This process's place among torchrun's workers, or None when torchrun did not start it."""
    if not all(environ.get(k) for k in _SET_BY_TORCHRUN):
        return None
    try:
        return Worker(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]))
    except ValueError:
        raise ConfigError(f"torchrun's RANK, WORLD_SIZE and LOCAL_RANK must be integers, got "
                          f"{environ['RANK']!r}, {environ['WORLD_SIZE']!r}, {environ['LOCAL_RANK']!r}") from None


def command() -> list[str]:
    """How to run torchrun: the one beside this interpreter (a virtualenv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "torchrun"
    return [str(beside)] if beside.exists() else [shutil.which("torchrun") or "torchrun"]


def workers_store(environ: Mapping[str, str], timeout: float) -> Optional[tuple["dist.Store", str]]:
    """A client of torchrun's own store (``MASTER_ADDR:MASTER_PORT``, kept by its agent across
    restarts of the workers), where its workers meet for their process groups, and its address;
    None when torchrun did not start this process."""
    if worker(environ) is None:
        return None
    host, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        raise ConfigError(f"torchrun set no usable MASTER_ADDR/MASTER_PORT ({host!r}, {port!r})")
    import torch.distributed as dist
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return store, f"{host}:{port}"


def as_worker(role: str, spec: TorchrunSpec, flags: Mapping[str, Any], environ: Mapping[str, str]
              ) -> tuple[dict[str, Any], dict[str, str]]:
    """The flags and environment a ``role`` process reads its settings from: unchanged outside
    torchrun; under it, named ``<role><RANK>``, its count setting the world size, the sidecar
    port offset by the local rank, and ``spec.defaults`` where nothing else is said."""
    flags, environ = dict(flags), dict(environ)
    count_field = spec.count
    me = worker(environ)
    if me is None:
        return flags, environ
    if flags.get("name"):
        raise ConfigError(f"torchrun names its workers: this one is {role}{me.rank}; leave --name out")
    count_flag = "--" + count_field.replace("_", "-")
    if flags.get(count_field) is not None and str(flags[count_field]) != str(me.world_size):
        raise ConfigError(f"{count_flag} {flags[count_field]} disagrees with torchrun's WORLD_SIZE {me.world_size}; "
                          f"leave {count_flag} out")
    if not (flags.get("ps_addr") or environ.get("RPCPS_PS_ADDR")):
        raise ConfigError("under torchrun, MASTER_ADDR and MASTER_PORT are torchrun's own rendezvous (its workers' "
                          "process group): say where the servers' store is with --ps-addr HOST:PORT or RPCPS_PS_ADDR")
    environ["RPCPS_NAME"] = f"{role}{me.rank}"
    flags[count_field] = str(me.world_size)
    for field, value in spec.defaults:
        if flags.get(field) is None and not environ.get(env_name(field)):
            flags[field] = value
    base = flags.get("sidecar_port") or environ.get("RPCPS_SIDECAR_PORT") or CommonConfig.model_fields["sidecar_port"].default
    if str(base).isdigit() and int(base) != 0:
        flags["sidecar_port"] = str(int(base) + me.local_rank)
    return flags, environ
