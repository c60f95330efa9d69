"""What processes listen on, as the machine reports it (``ss``): for tests that hold a cluster to
"nothing is open that need not be"."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest


def listening(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, local address:port) of every TCP listener of ``pids``."""
    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("ss (iproute2) is not installed")
    out = subprocess.run([ss, "-ltnpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in pids:
                found.append((int(pid), fields[3]))
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host == "::1"
