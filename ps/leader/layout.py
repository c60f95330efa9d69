"""The job's layout (``ps/spec/sharding.py``'s ``Slots``), owned by the leader.

The leader chooses the layout the job starts with, from the checkpoint it restores
(``ps/spec/sharding.py``'s ``resumed_slots``). It publishes it in the rendezvous store, where a server
starting reads it before it builds its shard, and serves it to clients (``PsSurface.layout_now``
on the leader). Every other member holds a copy; a request planned with an old one is refused as
``StaleLayout``, and its caller asks the leader again. The epoch only rises.
"""
from __future__ import annotations

import datetime
import json
import logging
from typing import Any, Optional

from ps.spec.model import ModelSpec
from ps.spec.sharding import Slots, resumed_slots

log = logging.getLogger("ps.server.role")

LAYOUT_KEY = "rpcps/layout"     # in the rendezvous store: the leader's layout, as JSON


def publish(store: Any, slots: Slots) -> None:
    """The leader: the layout for servers that start later (they build their shard by it)."""
    store.set(LAYOUT_KEY, json.dumps(slots.to_dict()))


def published(store: Any, timeout: float) -> Slots:
    """A server other than the leader, before it joins: the leader's layout."""
    store.wait([LAYOUT_KEY], datetime.timedelta(seconds=timeout))
    return Slots.from_dict(json.loads(store.get(LAYOUT_KEY).decode()))


class Choice:
    """The layout a server builds its shard by. The leader chooses it for the checkpoint it
    restores, so it is chosen again for each one tried (``of``); any other server is ``given``
    the leader's published one, whichever checkpoint it restores."""

    def __init__(self, spec: ModelSpec, servers: list[str], given: Optional[Slots] = None) -> None:
        self._spec, self._servers, self._given = spec, servers, given
        self._last: Optional[Slots] = None

    def of(self, info: Optional[Any]) -> Slots:
        """For the checkpoint ``info`` (a ``CheckpointInfo``; None: a fresh start)."""
        if self._given is not None:
            return self._given
        self._last = resumed_slots(self._spec, self._servers, info.meta.get("layout") if info is not None else None)
        return self._last

    def holds(self, server: str) -> bool:
        """Whether the layout names ``server`` (one started beside a running job is not named
        until the leader moves slots to it)."""
        if self._given is None or server in self._given.servers:
            return True
        log.info("%s is not in the leader's layout %d (%s): it joins holding nothing", server, self._given.epoch,
                 ", ".join(self._given.servers))
        return False

    @property
    def last(self) -> Slots:
        """The one chosen for the checkpoint tried last (a fresh start's, if none was)."""
        return self._last if self._last is not None else self.of(None)
