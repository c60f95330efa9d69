"""A server's side of a change of layout, served beside it (``MoveSurface``): its part of slots
and units for a destination, taking its own parts from their sources, and the rebuild of its shard
by the new layout behind the server's gate (``ps/server/moves.py`` says how)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ps.server.delta import held_state
from ps.server.moves import part_of
from ps.server.service import ParameterServer, build_shard
from ps.server.update import all_cores
from ps.spec.sharding import Slots
from ps.spec.surface import MoveSurface
from services.errors import NotSupported
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
    def part(self, slots: list[int], units: list[str]) -> dict[str, Any]:
        with all_cores():       # under the trainers' hold, as a checkpoint's copy
            started = time.monotonic()
            part = part_of(held_state(self.server), self.server.layout, slots, units)
        log.info("copied out %d slots and %d units in %.3fs", len(slots), len(units), time.monotonic() - started)
        return part

    @remote
    def take_part(self, source: str, slots: list[int], units: list[str], epoch: int) -> int:
        return self.server.staged.take_from(source, MoveSurface.part, slots, units, epoch)

    @remote
    def relayout(self, layout: dict[str, Any]) -> dict[str, Any]:
        server, slots = self.server, Slots.from_dict(layout)
        # Its own state and what it took, rebuilt by the new layout, with every core (the trainers are held).
        with server.gate.closed(), all_cores():
            started = time.monotonic()
            build_shard(server, slots, slots.position(server.name),
                        [held_state(server), *server.staged.take(slots.epoch)], complete=False)
        log.info("rebuilt by layout %d in %.3fs", slots.epoch, time.monotonic() - started)
        self._relaid()
        return {"epoch": slots.epoch, "rows": sum(p.rows(server.shard) for p in server.layout.plans.values())}
