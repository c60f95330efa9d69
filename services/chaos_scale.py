"""``rpcps chaos --fault scale``: the job moved onto one server more or one fewer, at random, while
it trains, ``--kills`` times: each change as a user makes it (``POST /scale`` on the leader, which
``rpcps up`` follows by starting the new server or letting the drained one go), its figures (the
trainers' hold, bytes moved, seconds), and whether the servers still hold every row once: the rows
of the layout's servers add up to what they held before the first change."""
from __future__ import annotations

import random
import statistics
from typing import Any, Callable, Optional

from services.client import ChangeFailed, SidecarClient, SidecarError

MAX_SERVERS = 8             # the most servers a change moves onto
WAIT = 600.0                # seconds a change (with its new server's start) may take


class Rescales:
    def __init__(self, cluster: Any, rng: random.Random, pause: Callable[[float], None], interval: float,
                 client: Callable[..., Any] = SidecarClient) -> None:
        """``cluster``: ``services/chaos.py``'s ``Cluster`` (cluster.json and the sidecars);
        ``client``: a sidecar's client, made as ``SidecarClient`` is."""
        self.cluster, self._rng, self._pause, self._interval = cluster, rng, pause, interval
        self._client = client

    def servers(self) -> list[str]:
        """The servers of the leader's layout."""
        leader = self.cluster.status(self.cluster.state()["leader"]) or {}
        return list(((leader.get("layout") or {}).get("servers") or {}))

    def rows(self, servers: list[str]) -> Optional[int]:
        """The rows ``servers`` hold together (None: one did not answer)."""
        held = [(self.cluster.status(n) or {}).get("rows") for n in servers]
        return None if any(r is None for r in held) else sum(held)

    def run(self, times: int) -> list[dict[str, Any]]:
        servers = self.servers()
        if not servers:
            raise SystemExit("rpcps chaos: --fault scale moves a job's parameter servers, and this cluster's "
                             "leader shows no layout")
        first = self.rows(servers)
        return [self.one(first) for _ in range(times)]

    def one(self, rows_before: Optional[int]) -> dict[str, Any]:
        self._pause(self._rng.expovariate(1.0 / self._interval))
        now = self.servers()
        grow = len(now) == 1 or (len(now) < MAX_SERVERS and self._rng.random() < 0.5)
        to = len(now) + (1 if grow else -1)
        state = self.cluster.state()
        record: dict[str, Any] = {"fault": "scale", "from": len(now), "to": to}
        try:
            with self._client(state["sidecars"][state["leader"]], token=self.cluster.token, timeout=WAIT) as c:
                change = c.scaled(to, timeout=WAIT)
        except (ChangeFailed, SidecarError, OSError) as exc:
            return {**record, "done": False, "error": str(exc).splitlines()[0]}
        after = self.servers()
        held = self.rows(after)
        return {**record, "done": change.get("state") == "done" and len(after) == to,
                "epoch": change.get("epoch"), "pause_seconds": change.get("pause_seconds"),
                "seconds": change.get("seconds"), "bytes": change.get("bytes"), "rows": held,
                "rows_held_once": rows_before is not None and held == rows_before}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``rpcps chaos``'s summary of changes: ``kills`` made, ``recovered`` those done with every
    row held once (the exit code is 0 when they are equal), the hold's median and maximum."""
    held = [r["pause_seconds"] for r in records if r.get("done")]
    return {"fault": "scale", "kills": len(records), "recovered": sum(1 for r in records if r.get("done") and r.get("rows_held_once")),
            "median_pause_seconds": statistics.median(held) if held else None,
            "max_pause_seconds": max(held) if held else None}


def human(e: dict[str, Any]) -> str:
    if e["event"] == "kill":
        if not e.get("done"):
            return f"{e['from']} -> {e['to']} servers: {e.get('error') or 'not done'}"
        return (f"{e['from']} -> {e['to']} servers: layout {e['epoch']}, trainers held {e['pause_seconds']}s, "
                f"{e['bytes']} bytes, rows {'held once' if e['rows_held_once'] else 'NOT held once'}")
    return (f"{e['kills']} changes, {e['recovered']} done with every row held once; trainers held a median "
            f"{e['median_pause_seconds']}s (max {e['max_pause_seconds']}s)")
