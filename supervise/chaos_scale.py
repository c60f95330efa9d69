"""``rpcps chaos --fault scale``: the job moved onto one server more or one fewer, at random, while
it trains, ``--kills`` times: each change as a user makes it (``POST /scale`` on the leader, which
``rpcps up`` follows by starting the new server or letting the drained one go), its figures (the
trainers' hold, bytes moved, seconds), and whether the servers still hold every row once: the rows
of the layout's servers add up to what they held before the first change.

``--fault scale-kill``: the same changes, each with a member killed while it moves: a source, a
destination, the leader or a trainer, chosen at random, at a random moment after the leader shows
the change under way, within the time the last change made took (``KILL_WITHIN`` seconds before
one is timed), so that kills fall in every phase of a change whatever its size. The change completes or changes nothing; once the member is
back (``Chaos.fault_one``), the servers of whichever layout is in force hold every row once."""
from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any, Callable, Optional

import httpx

from services.client import ChangeFailed, SidecarClient, SidecarError
from supervise.placement import placed_of

MAX_SERVERS = 8             # the most servers a change moves onto
WAIT = 600.0                # seconds a change (with its new server's start) may take
KILL_WITHIN = 2.0           # --fault scale-kill: seconds after a change is seen under way, at most, until one is timed
ROLES = ("source", "destination", "leader", "trainer")
SETTLE = 120.0              # seconds the servers may take to hold every row again after a kill


class Rescales:
    def __init__(self, cluster: Any, rng: random.Random, pause: Callable[[float], None], interval: float,
                 client: Callable[..., Any] = SidecarClient,
                 during: Optional[Callable[[str], dict[str, Any]]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``cluster``: ``supervise/chaos.py``'s ``Cluster`` (cluster.json and the sidecars);
        ``client``: a sidecar's client, made as ``SidecarClient`` is; ``during``: kill this member
        and wait until it is back, its record (``Chaos.fault_one``): each change then has a member
        killed while it moves; ``clock``: seconds, as ``pause`` spends them."""
        self.cluster, self._rng, self._pause, self._interval = cluster, rng, pause, interval
        self._client, self._during, self._clock = client, during, clock
        self._lasts = KILL_WITHIN       # seconds the last change made took, from its start

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
        record: dict[str, Any] = {"fault": "scale" if self._during is None else "scale-kill", "from": len(now), "to": to}
        if self._during is None:
            record.update(self._made(to))
        else:
            record.update(self._made_with_a_kill(to, now))
        held = self._settled(rows_before) if self._during is not None else self.rows(self.servers())
        record["done"] = bool(record.get("done")) and len(self.servers()) == to
        return {**record, "rows": held, "rows_held_once": rows_before is not None and held == rows_before}

    def _made(self, to: int) -> dict[str, Any]:
        """The change onto ``to`` servers, asked of the leader and followed to its end."""
        state = self.cluster.state()
        try:
            with self._client(state["sidecars"][state["leader"]], token=self.cluster.token, timeout=WAIT) as c:
                change = c.scaled(to, timeout=WAIT)
        except (ChangeFailed, SidecarError, OSError, httpx.HTTPError) as exc:    # the leader may be what was killed
            return {"done": False, "error": str(exc).splitlines()[0] or type(exc).__name__}
        return {"done": change.get("state") == "done", "epoch": change.get("epoch"),
                "pause_seconds": change.get("pause_seconds"), "seconds": change.get("seconds"),
                "bytes": change.get("bytes")}

    def _made_with_a_kill(self, to: int, now: list[str]) -> dict[str, Any]:
        """The change onto ``to`` servers, asked in a thread, with a member killed once the leader
        shows it under way, and waited for until it is back."""
        outcome: dict[str, Any] = {}
        asked = threading.Thread(target=lambda: outcome.update(self._made(to)), daemon=True)
        asked.start()
        change = self._under_way(asked)
        self._pause(self._rng.uniform(0.0, self._lasts))
        leader = self.cluster.state()["leader"]
        moving = ((self.cluster.status(leader) or {}).get("change") or {}).get("state") == "moving"
        role, victim = self.victim(change or {"from": now, "to": now}, leader)
        killed = self._during(victim)
        asked.join(WAIT)
        if outcome.get("done") and outcome.get("seconds"):
            self._lasts = float(outcome["seconds"])
        return {**outcome, "role": role, "victim": victim, "killed_while_moving": moving, "kill": killed}

    def _under_way(self, asked: threading.Thread) -> Optional[dict[str, Any]]:
        """The leader's change once it shows it moving (None: it ended, or failed, first)."""
        while asked.is_alive():
            change = (self.cluster.status(self.cluster.state()["leader"]) or {}).get("change") or {}
            if change.get("state") == "moving":
                return change
            self._pause(0.05)
        return None

    def victim(self, change: dict[str, Any], leader: str) -> tuple[str, str]:
        """A role of the change, at random among those someone plays, and a member playing it: a
        server giving slots (source), one taking them (destination), the leader, or a trainer."""
        before, after = list(change.get("from") or []), list(change.get("to") or [])
        grows = len(after) > len(before)
        # Growing, every server gives slots to the new one; shrinking, the one leaving gives its own.
        sources = [n for n in before if n != leader] if grows else [n for n in before if n not in after]
        destinations = [n for n in after if n not in before] if grows else [n for n in after if n != leader]
        playing = {"source": sources, "destination": destinations, "leader": [leader],
                   "trainer": [n for n in placed_of(self.cluster.state()) if not n.startswith("ps")]}
        role = self._rng.choice([r for r in ROLES if playing[r]])
        return role, self._rng.choice(sorted(playing[role]))

    def _settled(self, rows_before: Optional[int]) -> Optional[int]:
        """The rows the layout's servers hold once they hold ``rows_before`` again, or as they
        stand after ``SETTLE`` seconds (a server killed is restoring, the leader starting again)."""
        deadline = self._clock() + SETTLE
        held = self.rows(self.servers())
        while held != rows_before and self._clock() < deadline:
            self._pause(0.5)
            held = self.rows(self.servers())
        return held


def recovered(record: dict[str, Any]) -> bool:
    """A change done with every row held once; with a kill in it (``scale-kill``), done or not
    (a change that fails changes nothing), with the member back and every row held once."""
    if "victim" in record:
        return bool(record.get("rows_held_once")) and record["kill"].get("back_at") is not None
    return bool(record.get("done") and record.get("rows_held_once"))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``rpcps chaos``'s summary of changes: ``kills`` made, ``recovered`` as ``recovered`` says
    (the exit code is 0 when they are equal), the hold's median and maximum; with kills in them,
    how many were done and by whose kill."""
    held = [r["pause_seconds"] for r in records if r.get("done") and r.get("pause_seconds") is not None]
    out = {"fault": records[0]["fault"] if records else "scale", "kills": len(records),
           "recovered": sum(1 for r in records if recovered(r)),
           "median_pause_seconds": statistics.median(held) if held else None,
           "max_pause_seconds": max(held) if held else None}
    if any("victim" in r for r in records):
        out["done"] = sum(1 for r in records if r.get("done"))
        out["by_role"] = {role: sum(1 for r in records if r.get("role") == role) for role in ROLES}
    return out


def human(e: dict[str, Any]) -> str:
    if e["event"] == "kill" and "victim" in e:
        when = "while it moved" if e["killed_while_moving"] else "(the change had ended)"
        made = f"layout {e['epoch']} made" if e.get("done") else f"failed, changing nothing ({e.get('error') or '-'})"
        back = "let go, as it was leaving" if e["kill"].get("let_go") else \
            f"back in {e['kill']['seconds']}s" if e["kill"].get("back_at") else e["kill"].get("error", "not back")
        return (f"{e['from']} -> {e['to']} servers, {e['role']} {e['victim']} killed {when}: {made}; {e['victim']} "
                f"{back}; rows {'held once' if e['rows_held_once'] else 'NOT held once'}")
    if e["event"] == "kill":
        if not e.get("done"):
            return f"{e['from']} -> {e['to']} servers: {e.get('error') or 'not done'}"
        return (f"{e['from']} -> {e['to']} servers: layout {e['epoch']}, trainers held {e['pause_seconds']}s, "
                f"{e['bytes']} bytes, rows {'held once' if e['rows_held_once'] else 'NOT held once'}")
    if "by_role" in e:
        return (f"{e['kills']} changes with a member killed in each ({', '.join(f'{n} {r}' for r, n in e['by_role'].items())}), "
                f"{e['done']} made, {e['recovered']} recovered with every row held once")
    return (f"{e['kills']} changes, {e['recovered']} done with every row held once; trainers held a median "
            f"{e['median_pause_seconds']}s (max {e['max_pause_seconds']}s)")
