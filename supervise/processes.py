"""Processes of a local cluster: free ports for them, starting one, stopping them in waves.

``rpcps up``, the benchmarks and the tests start roles the same way, through these.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)

_FIRST_PORT = 20000    # above the well-known and most registered services' ports
_handed_out: set[int] = set()          # by free_port, in this process: never twice
_handed_out_lock = threading.Lock()


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive ports free on loopback (a role listens at a base port
    plus its index, as torchrun's workers' sidecars do). Taken below the kernel's ephemeral
    range: there no outgoing connection can take one before its listener binds it."""
    top = _ephemeral_low()
    if top - count <= _FIRST_PORT:    # no room below it: anywhere, as a last resort
        top = 65536
    with _handed_out_lock:
        for _ in range(200):
            ports = range(base := random.randrange(_FIRST_PORT, top - count), base + count)
            if _handed_out.isdisjoint(ports) and all(map(_bindable, ports)):
                _handed_out.update(ports)
                return base
    raise RuntimeError(f"no {count} consecutive free ports in {_FIRST_PORT}-{top - 1}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768        # Linux's default; elsewhere a guess that is still a free port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True



def spawn_logged(argv: list[str], log_path: Path, env: Optional[dict] = None,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen, cwd: Optional[Path] = None
                 ) -> subprocess.Popen:
    """Start ``argv`` in its own session with ``popen`` (a ``Popen`` that starts it on a host, or
    as a job step), output appended to ``log_path``, Python's unbuffered."""
    with open(log_path, "ab") as logf:
        return popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                     cwd=cwd, env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})


def spawn_role(module: str, argv: list[str], log_path: Path, env: Optional[dict] = None) -> subprocess.Popen:
    """Start ``python -m module argv`` in its own session, output appended to ``log_path``."""
    return spawn_logged([sys.executable, "-m", module, *argv], log_path, env)


def stop_in_waves(waves: list[list[tuple[str, subprocess.Popen]]], timeout: float) -> None:
    """SIGTERM each wave and wait for it before the next; SIGKILL whatever outlives the deadline."""
    deadline = time.monotonic() + timeout
    for i, wave in enumerate(waves):
        live = [(n, p) for n, p in wave if p.poll() is None]
        for _, p in live:
            p.send_signal(signal.SIGTERM)
        wave_deadline = min(deadline, time.monotonic() + timeout * (i + 1) / len(waves) + 2)
        for name, p in live:
            try:
                p.wait(max(0.0, wave_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                p.kill()
                p.wait()
    for wave in waves:
        for _, p in wave:
            if p.poll() is None:
                p.kill()
                p.wait()
