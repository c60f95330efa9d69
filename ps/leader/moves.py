"""The leader's changes of layout while training goes on (``ps/server/moves.py`` is each
server's side): servers join and leave a running job.

``Mover.change(servers)`` makes the next layout over ``servers`` (``Slots.rebalanced``: the fewest
slots move) and runs the difference of the two. First, while training goes on, each destination
copies what comes to it from its source and every server builds its shard by the new layout aside
(``ps/server/precopy.py``). Then, with the trainers held at a step boundary as a checkpoint holds
them (in sync and ssp by the step clock's freeze, so the change falls between two steps), each
destination takes what changed since, every server of either layout puts it in and serves by the
new layout, and the leader adopts it (``Leading.adopt``: published, recorded in the next
checkpoints). The trainers take the new layout as they go on. Nothing moves unless every server of
the new layout is a member; a change that fails before the rebuilds leaves the old layout whole.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from ps.spec.sharding import Move, Slots
from ps.spec.surface import ChangeSurface, MoveSurface
from services.errors import BadRequest, NotReady, PeerUnavailable
from services.failpoints import reached
from services.membership import current_members
from services.remote import call, remote

log = logging.getLogger("ps.server.role")

STEP_TIMEOUT = 600.0        # seconds one server's part of a change may take
# Seconds a destination may take what was written since its copy ahead, the trainers held (it
# took 0.08 s at Criteo's full size): a destination frozen then holds them no longer than this.
HELD_TAKE_TIMEOUT = 60.0


def by_destination(moves: list[Move]) -> dict[str, dict[str, tuple[list[int], list[str]]]]:
    """``moves`` as each destination takes them: per source, its slots and units."""
    out: dict[str, dict[str, tuple[list[int], list[str]]]] = {}
    for m in moves:
        slots, units = out.setdefault(m.destination, {}).setdefault(m.source, ([], []))
        if m.what.startswith("slot:"):
            slots.append(int(m.what.split(":", 1)[1]))
        else:
            units.append(m.what)
    return out


def change_name(epoch: int) -> str:
    """A name for one attempt at a change of layout to ``epoch`` (what the servers keep for it is
    kept under it): its epoch and a random tail, since a failed attempt and the next share the epoch."""
    return f"{epoch}.{uuid.uuid4().hex[:8]}"


class Mover(ChangeSurface):
    def __init__(self, current: Callable[[], Slots], adopt: Callable[[Slots], None],
                 paused: Callable[[Callable[[], Any]], tuple[Any, float]],
                 evict: Callable[[list[str], str], None], members: Callable[[], list[str]] = current_members,
                 transport: Callable[..., Any] = call, ended: Callable[[dict[str, Any]], None] = lambda last: None) -> None:
        """``current``/``adopt``: the leader's layout, and its taking a new one; ``paused``: run an
        action with the trainers held (``Coordinator.paused``); ``evict``: members out of the group
        with a reason (``Membership.evict``); ``ended``: told of each change that ran, done or
        failed (``last``)."""
        self._current, self._adopt, self._paused, self._ended = current, adopt, paused, ended
        self._members = members
        self._servers = ChangeCalls(members, transport, evict)
        self._lock = threading.Lock()       # one change at a time
        self.last: dict[str, Any] = {}      # the last change, for /status
        self._started = 0.0                 # when it began (monotonic)
        self.wanted: Optional[list[str]] = None   # the servers a change asked for waits on to serve

    def request(self, servers: list[str]) -> dict[str, Any]:
        """Move the job onto ``servers``: now, when every one serves; else once they do (a
        supervisor or an engine starting them meanwhile, ``tick``), and what it waits for."""
        absent = [n for n in servers if n not in self._members()]
        if not absent:
            self.wanted = None
            return self.change(servers)
        self.wanted = list(servers)
        log.info("a change onto %s waits for %s to serve", servers, ", ".join(absent))
        return {"state": "waiting", "to": list(servers), "awaiting": absent, "epoch": self._current().epoch}

    def progress(self) -> Optional[dict[str, Any]]:
        """The last change as ``/status`` shows it (None: none yet); one under way with its
        seconds so far."""
        last = dict(self.last)
        if last.get("state") == "moving":
            last["elapsed_seconds"] = round(time.monotonic() - self._started, 3)
        return last or None

    def tick(self) -> None:
        """The change asked for, once every server it waits on serves (in a thread of its own)."""
        wanted = self.wanted
        if wanted is None or self._lock.locked() or any(n not in self._members() for n in wanted):
            return
        self.wanted = None

        def run() -> None:
            try:
                self.change(wanted)
            except Exception as exc:  # noqa: BLE001 - said in the status (``last``) and the log
                log.error("%s", str(exc).splitlines()[0])
        threading.Thread(target=run, name="layout-change", daemon=True).start()

    @remote
    def change(self, servers: list[str], retire: bool = True) -> dict[str, Any]:
        if not self._lock.acquire(blocking=False):
            raise NotReady("a change of layout is under way; ask again when it has finished")
        try:
            old = self._current()
            result = self._change(servers)
        finally:
            self._lock.release()
        for name in [n for n in old.servers if n not in servers] if retire else []:
            try:
                self._servers.retire(name)
            except Exception as exc:  # noqa: BLE001 - it holds nothing now; stopping it is the engine's then
                log.warning("could not retire %s: %s", name, str(exc).splitlines()[0])
        return result

    def _change(self, servers: list[str]) -> dict[str, Any]:
        old = self._current()
        if not servers or servers[0] != old.servers[0]:
            raise BadRequest(f"the servers must begin with the leader, {old.servers[0]}; got {servers}")
        if list(servers) == list(old.servers):
            return {"epoch": old.epoch, "from": list(servers), "to": list(servers), "state": "unchanged",
                    "moved_slots": 0, "moved_units": [], "bytes": 0, "pause_seconds": 0.0, "take_seconds": 0.0,
                    "rebuild_seconds": 0.0, "seconds": 0.0}
        absent = [n for n in servers if n not in self._members()]
        if absent:
            raise NotReady(f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not serving yet: start "
                           f"{'it' if len(absent) == 1 else 'them'} first (rpcps ps --name NAME ...)")
        new = old.rebalanced(servers)
        moves = old.moves(new)
        self._started = started = time.monotonic()
        change = change_name(new.epoch)
        self.last = {"epoch": new.epoch, "attempt": change, "from": list(old.servers), "to": list(servers),
                     "state": "moving",
                     "moved_slots": sum(1 for m in moves if m.what.startswith("slot:")),
                     "moved_units": [m.what for m in moves if not m.what.startswith("slot:")]}
        log.info("layout %d -> %d: %s -> %s, %d slots and %d units move", old.epoch, new.epoch, list(old.servers),
                 servers, self.last["moved_slots"], len(self.last["moved_units"]))
        try:
            ahead = self._ahead(old, new, moves, change)
            (sent, phases), pause = self._paused(lambda: self._switch(old, new, moves, change, ahead))
        except Exception as exc:
            self.last.update(state="failed", error=str(exc).splitlines()[0])
            self._ended(dict(self.last))
            # Nothing was adopted: the old layout is whole. Said so, and as a peer's absence (503),
            # since what fails a change is a member gone or not yet known (a replacement joining).
            raise PeerUnavailable(f"the change onto {', '.join(servers)} failed, layout {old.epoch} stays in "
                                  f"force: {self.last['error']}; ask again once every server serves") from exc
        self.last.update(state="done", bytes=sent, pause_seconds=round(pause, 3), **phases,
                         seconds=round(time.monotonic() - started, 3))
        self._ended(dict(self.last))
        log.info("layout %d in force: %d bytes sent, trainers held %.3fs", new.epoch, sent, pause)
        return dict(self.last)

    def _ahead(self, old: Slots, new: Slots, moves: list[Move], change: str) -> bool:
        """While training goes on: the moving slots' plain rows copied to their destinations, and
        every server's shard by ``new`` built aside (``ps/server/precopy.py``), so that the hold
        copies only what training wrote meanwhile. Whether it did; if not, the hold copies all,
        unless a server of the change has left the members: then holding the trainers to copy all
        could only fail the same way, so the change fails at once."""
        started = time.monotonic()
        everyone = list(dict.fromkeys([*old.servers, *new.servers]))
        try:
            sent = self._servers.take(moves, change, "early")
            self._servers.prepare(everyone, new, change)
        except Exception as exc:  # noqa: BLE001 - the hold then copies everything, as it can
            gone = [n for n in everyone if n not in self._members()]
            if gone:
                raise NotReady(f"{', '.join(gone)} left the members while copying ahead") from exc
            log.warning("copying ahead for layout %d failed (%s): the trainers are held while all of it is copied",
                        new.epoch, str(exc).splitlines()[0])
            return False
        self.last.update(ahead_bytes=sent, ahead_seconds=round(time.monotonic() - started, 3))
        return True

    def _switch(self, old: Slots, new: Slots, moves: list[Move], change: str,
                ahead: bool) -> tuple[int, dict[str, float]]:
        """Under the trainers' hold: the parts taken (``ahead``: only what changed since they were
        copied), every shard rebuilt, the layout adopted; the bytes sent, and the seconds of the
        taking and of the rebuilds (where a hold goes)."""
        started = time.monotonic()
        sent = self._servers.take(moves, change, "changes" if ahead else "all")
        taken = time.monotonic()
        everyone = list(dict.fromkeys([*old.servers, *new.servers]))
        failed = self._servers.rebuild(everyone, new, change)
        if len(failed) == len(everyone):
            raise next(iter(failed.values()))       # none rebuilt: the old layout is whole still
        # Once one server has rebuilt, the new layout is the only one whose slots each have one
        # owner: it is adopted. A server that did not rebuild (it died) starts again from the
        # last checkpoint by it, losing what it learned since, as any lost server does.
        reached("adopt")
        self._adopt(new)
        if failed:
            self.last["not_rebuilt"] = sorted(failed)
            self._servers.not_rebuilt(failed, new.epoch)
        return sent, {"take_seconds": round(taken - started, 3), "rebuild_seconds": round(time.monotonic() - taken, 3)}


class ChangeCalls:
    """What a change of layout asks of the servers, each step of every server at once."""

    def __init__(self, members: Callable[[], list[str]], transport: Callable[..., Any],
                 evict: Callable[[list[str], str], None]) -> None:
        """``members``: who is in the group now; ``transport``: a call to a server (``call``);
        ``evict``: members out of the group with a reason (``Membership.evict``)."""
        self._members, self._call, self._evict = members, transport, evict

    def take(self, moves: list[Move], change: str, stage: str) -> int:
        """Each destination's parts taken from their sources at ``stage``; the bytes sent."""
        takes = [(dest, source, slots, units) for dest, sources in by_destination(moves).items()
                 for source, (slots, units) in sources.items()]
        timeout = HELD_TAKE_TIMEOUT if stage == "changes" else STEP_TIMEOUT
        return sum(self.at_once([lambda t=t: self._call(t[0], MoveSurface.take_part, t[1], t[2], t[3], change,
                                                         stage, timeout=timeout) for t in takes]))

    def prepare(self, servers: list[str], new: Slots, change: str) -> None:
        """Every one of ``servers``' shard by ``new`` built aside, from what it took."""
        self.at_once([lambda n=n: self._call(n, MoveSurface.prepare, new.to_dict(), change, timeout=STEP_TIMEOUT)
                      for n in servers])

    def rebuild(self, servers: list[str], new: Slots, change: str) -> dict[str, Exception]:
        """Every one of ``servers`` rebuilt by ``new``; those that failed, tried once again if they
        are still members (a call that failed on its way, not in the server), with what failed."""
        failed: dict[str, Exception] = {}
        for attempt in range(2):
            names = servers if attempt == 0 else [n for n in failed if n in self._members()]
            results = self.at_once([lambda n=n: self._call(n, MoveSurface.relayout, new.to_dict(), change,
                                                           timeout=STEP_TIMEOUT)
                                    for n in names], errors=True)
            for name, result in zip(names, results):
                if isinstance(result, Exception):
                    failed[name] = result
                else:
                    failed.pop(name, None)
            if not failed:
                break
        return failed

    @staticmethod
    def at_once(calls: list[Callable[[], Any]], errors: bool = False) -> list[Any]:
        """``calls`` at once; their results (``errors``: an exception in the place of a call that
        raised it, else the first raised once every call has ended)."""
        if not calls:
            return []
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            futures = [pool.submit(c) for c in calls]
        out = [f.exception() or f.result() for f in futures]
        first = next((r for r in out if isinstance(r, Exception)), None)
        if first is not None and not errors:
            raise first
        return out

    def not_rebuilt(self, failed: dict[str, Exception], epoch: int) -> None:
        """``failed`` did not rebuild by layout ``epoch``, which is adopted. One that left starts
        again from the last checkpoint by it; one that failed twice and still answers holds the
        old layout's shard, and the trainers, on the new one, would have their steps refused by
        it (for the slots it was to take): out of the group, it starts again as a lost one does."""
        for name, exc in failed.items():
            log.error("%s did not rebuild its shard by layout %d: %s; it holds it from its last checkpoint "
                      "when it starts again", name, epoch, str(exc).splitlines()[0])
        alive = [n for n in failed if n in self._members()]
        try:
            if alive:
                self._evict(alive, f"did not rebuild its shard by layout {epoch}")
        except Exception as exc:  # noqa: BLE001 - the layout is adopted: the change stands
            log.error("could not put %s out of the group: %s; restart it", ", ".join(alive), str(exc).splitlines()[0])

    def retire(self, name: str) -> None:
        self._call(name, MoveSurface.retire, timeout=STEP_TIMEOUT)
