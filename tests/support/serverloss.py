"""A parameter server lost under training, as an operator sees it: ``kill -9`` of a server other
than the leader while ``rpcps up`` runs. The trainers must stay the same processes, say that they
wait for it, step again once it is back, and log no traceback."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from services.client import SidecarClient
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until


def _status(url: str) -> dict[str, Any]:
    with SidecarClient(url, timeout=2.0) as c:
        return c.status()


def _log_sizes(up: UpProcess) -> dict[Path, int]:
    return {f: f.stat().st_size for f in (up.state_dir / "logs").glob("*.log")}


def _written_since(sizes: dict[Path, int], up: UpProcess) -> str:
    out = []
    for f in sorted((up.state_dir / "logs").glob("*.log")):
        with open(f, "rb") as log:
            log.seek(sizes.get(f, 0))
            out.append(log.read().decode(errors="replace"))
    return "\n".join(out)


def lose_server(up: UpProcess, server: str, trainers: list[str], times: int = 2) -> list[float]:
    """Kill ``server`` ``times`` times, each once every trainer has stepped since the last. The
    seconds from each return (its sidecar says it serves) to the trainers' first step after it."""
    urls = up.cluster()["sidecars"]
    pids = {n: up.cluster()["pids"][n] for n in trainers}
    sizes = _log_sizes(up)
    restarts_before = len([e for e in up.drain() if e["event"] == "restart"])
    gaps = []
    for k in range(1, times + 1):
        victim = up.cluster()["pids"][server]
        os.kill(victim, signal.SIGKILL)
        waited: set[str] = set()

        def seen_going() -> bool:
            statuses = [_status(urls[n]) for n in trainers]
            for n, s in zip(trainers, statuses):
                if s.get("waiting_for") == [server]:
                    waited.add(n)
                assert s.get("server_losses", 0) <= k, s
            return all(s.get("server_losses", 0) == k for s in statuses)
        wait_until(seen_going, 30, f"every trainer to lose its step to {server}'s loss {k}")
        steps = {n: _status(urls[n])["step"] for n in trainers}

        def serving() -> float:
            if up.cluster()["pids"][server] == victim:
                return 0.0
            try:
                return time.monotonic() if _status(urls[server]).get("state") == "running" else 0.0
            except Exception:  # noqa: BLE001 - its sidecar is not up yet
                for n in trainers:
                    if _status(urls[n]).get("waiting_for") == [server]:
                        waited.add(n)
                return 0.0
        back = wait_until(serving, 60, f"{server} back")
        wait_until(lambda: all(_status(urls[n])["step"] > steps[n] for n in trainers), 30,
                   f"every trainer stepping after {server}'s return")
        gaps.append(time.monotonic() - back)
        assert waited == set(trainers), f"trainers that showed waiting_for [{server}]: {sorted(waited)}"
    assert {n: up.cluster()["pids"][n] for n in trainers} == pids, "a trainer was restarted"
    restarts = [e for e in up.drain() if e["event"] == "restart"][restarts_before:]
    assert [e["name"] for e in restarts] == [server] * times, restarts
    logs = _written_since(sizes, up)
    assert "Traceback" not in logs, logs[-5000:]
    assert " ERROR " not in logs, [line for line in logs.splitlines() if " ERROR " in line]
    return gaps
