"""A server's side of a change of layout, served beside it (``MoveSurface``): its part of slots
and units for a destination, taking its own parts from their sources, and the rebuild of its shard
by the new layout behind the server's gate (``ps/server/moves.py`` says how)."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Optional

from ps.server.delta import held_state
from ps.server.moves import part_of
from ps.server.precopy import built_by, by_rows, gathered_now, laid_out, plain_tables
from ps.server.service import ParameterServer, build_shard
from ps.server.update import all_cores, in_background, release_later
from ps.spec.sharding import Layout, Slots
from ps.spec.surface import MoveSurface
from services.errors import BadRequest, NotSupported
from services.failpoints import reached
from services.remote import remote

log = logging.getLogger("ps.server.role")


class ShardMoves(MoveSurface):
    def __init__(self, server: ParameterServer, stop: Callable[[], None] = lambda: None,
                 relaid: Callable[[], None] = lambda: None) -> None:
        """``stop``: the role's, when the leader retires this server; ``relaid``: told once its
        shard was rebuilt (its status shows the new layout at once)."""
        self.server, self._stop, self._relaid = server, stop, relaid

    @remote
    def retire(self) -> None:
        server = self.server
        if not server.empty:
            raise NotSupported(f"{server.name} holds part of layout {server.layout.epoch}: move it away first")
        log.info("retired by the leader: layout %d holds nothing here", server.layout.epoch)
        self._stop()

    @remote
    def part(self, slots: list[int], units: list[str], stage: str = "all",
             tables: Optional[list[str]] = None) -> dict[str, Any]:
        reached(f"part:{stage}")
        server = self.server
        if stage == "early":        # training goes on: the rows written from now on are sent again
            with server.optimizer.lock:
                server.params.touched.track()
            plain = [t for t in plain_tables(server.layout) if tables is None or t in tables]
            return in_background(lambda: self._copied(slots, units, stage, tables=plain, dense=False))
        if stage == "changes":
            moving = server.params.touched.moving
            if moving is None:
                raise BadRequest(f"{server.name} took no early copy under layout {server.layout.epoch}: ask for all")
            # Few rows: on one thread, as its requests are (a second core's thread only spins between
            # small copies, taking that core from another server copying its part at the same time).
            return self._copied(slots, units, stage, only=moving)
        with all_cores():
            return self._copied(slots, units, stage)

    def _copied(self, slots: list[int], units: list[str], stage: str, **which: Any) -> dict[str, Any]:
        started = time.monotonic()
        state = held_state(self.server)
        held = time.monotonic()
        part = part_of(state, self.server.layout, slots, units, **which)
        log.info("copied out %s of %d slots and %d units in %.3fs (%.3fs to read its state)", stage, len(slots),
                 len(units), time.monotonic() - started, held - started)
        return part

    @remote
    def take_part(self, source: str, slots: list[int], units: list[str], change: str, stage: str = "all") -> int:
        reached(f"take:{stage}")
        layout = self.server.layout
        pieces = by_rows(layout, layout.slots.position(source)) if stage == "early" else None
        return self.server.staged.take_from(source, MoveSurface.part, slots, units, change, stage, pieces)

    @remote
    def prepare(self, layout: dict[str, Any], change: str) -> None:
        reached("prepare")
        server, slots = self.server, Slots.from_dict(layout)
        with server.optimizer.lock:
            server.params.touched.track()     # before its own rows are read, as a source's before its part
        started = time.monotonic()
        shard, early = slots.position(server.name), list(server.staged.taken(change).early.values())
        # What stays keeps its columns, what comes fills empty ones: its own tensors, filled; with
        # too few empty columns, its shard built again aside, in the first columns of the new layout.
        columns = server.layout.columns_of(server.shard).after(slots, shard)
        new = Layout.of(server.spec, slots, columns)
        built = in_background(lambda: laid_out(held_state(server), early, new, shard, server.optimizer.lock))
        server.staged.keep_built(change, slots, columns, built)
        log.info("%s its shard by layout %d in %.3fs", "filled" if columns is not None else "built aside",
                 slots.epoch, time.monotonic() - started)

    @remote
    def relayout(self, layout: dict[str, Any], change: str) -> dict[str, Any]:
        reached("relayout")
        server, slots = self.server, Slots.from_dict(layout)
        # Its own state and what it took, rebuilt by the new layout: with every core when it copies
        # the whole shard (the trainers are held), on one thread when it puts the rows written since
        # into the shard built aside (few rows).
        with server.gate.closed():
            started = time.monotonic()
            shard, taken, moving = slots.position(server.name), server.staged.take(change), \
                server.params.touched.moving
            aside = built_by(taken, slots, moving)
            columns = taken.built[1] if aside else None     # else gathered whole, in the first columns
            own = held_state(server)
            with contextlib.nullcontext() if aside else all_cores():
                build_shard(server, slots, shard, None, gathered=gathered_now(
                    own, server.layout, moving, Layout.of(server.spec, slots, columns), shard, taken), columns=columns)
        release_later(own["params"], own["optim"], taken)     # the old shard and what it took, after the hold
        log.info("rebuilt by layout %d in %.3fs%s", slots.epoch, time.monotonic() - started,
                 " (copied ahead, the rows written since put in)" if aside else "")
        self._relaid()
        return {"epoch": slots.epoch, "rows": sum(p.held(server.shard) for p in server.layout.plans.values())}
