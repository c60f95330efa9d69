"""The job's layout (``ps/spec/sharding.py``'s ``Slots``), owned by the leader.

The leader chooses the layout the job starts with, from the checkpoint it restores
(``ps/spec/sharding.py``'s ``resumed_slots``), or from the one a change adopted since, which it
keeps beside the checkpoints (``record``). It publishes it in the rendezvous store, where a server
starting reads it before it builds its shard, and serves it to clients (``PsSurface.layout_now``
on the leader). Every other member holds a copy; a request planned with an old one is refused as
``StaleLayout``, and its caller asks the leader again. The epoch only rises.
"""
from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any, Optional

from ps.spec.model import ModelSpec
from ps.spec.sharding import Slots, resumed_slots
from services.checkpoint.handover import LeaderLife
from services.checkpoint.store import atomic_write

log = logging.getLogger("ps.server.role")

LAYOUT_KEY = "rpcps/layout"     # in the rendezvous store: the leader's layout, as JSON
LAYOUT_FILE = "layout.json"     # in the leader's checkpoint folder: the layout a change adopted last


def publish(store: Any, slots: Slots) -> None:
    """The leader: the layout for servers that start later (they build their shard by it)."""
    store.set(LAYOUT_KEY, json.dumps(slots.to_dict()))


def record(folder: Path, slots: Slots) -> None:
    """The leader, as a change of layout is adopted: the layout kept beside the checkpoints (the
    store dies with the leader, and the next checkpoint is yet to record it), so that a leader
    started again before that checkpoint builds by it, and the other servers keep the shards they
    handed over when it was lost, which are laid out by it."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(folder) / LAYOUT_FILE, lambda f: f.write(json.dumps(slots.to_dict()).encode()))


def recorded(folder: Path) -> Optional[dict[str, Any]]:
    """The layout ``record`` kept in ``folder`` (None: none, or unreadable)."""
    try:
        saved = json.loads((Path(folder) / LAYOUT_FILE).read_text())
        Slots.from_dict(saved)
        return saved
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget(folder: Path) -> None:
    """A fresh start: a layout kept from another job is not this one's."""
    (Path(folder) / LAYOUT_FILE).unlink(missing_ok=True)


def choice(spec: ModelSpec, servers: list[str], given: Optional[Slots], folder: Path) -> "Choice":
    """A server's choice of layout: the leader's published one (``given``), for any other server;
    the leader's own over ``servers`` (its ``--num-ps``), or, started again after it was lost (its
    predecessor's life left in ``folder``) with a layout kept from a change since the newest
    checkpoint, over that layout's servers: a lost leader's restart gives the job back as it was,
    where a stop and a start take the count asked for."""
    if given is not None:
        return Choice(spec, servers, given)
    kept = recorded(folder)
    if kept is not None and LeaderLife.left_behind(folder):
        servers = list(kept["servers"])
    return Choice(spec, servers, None, kept)


def published(store: Any, timeout: float) -> Slots:
    """A server other than the leader, before it joins: the leader's layout."""
    store.wait([LAYOUT_KEY], datetime.timedelta(seconds=timeout))
    return Slots.from_dict(json.loads(store.get(LAYOUT_KEY).decode()))


class Choice:
    """The layout a server builds its shard by. The leader chooses it for the checkpoint it
    restores, so it is chosen again for each one tried (``of``); any other server is ``given``
    the leader's published one, whichever checkpoint it restores."""

    def __init__(self, spec: ModelSpec, servers: list[str], given: Optional[Slots] = None,
                 kept: Optional[dict[str, Any]] = None) -> None:
        """``kept``: the leader's, the layout a change adopted after its newest checkpoint, if one
        did (``recorded``)."""
        self._spec, self._servers, self._given, self._kept = spec, servers, given, kept
        self._last: Optional[Slots] = None

    def of(self, info: Optional[Any]) -> Slots:
        """For the checkpoint ``info`` (a ``CheckpointInfo``; None: a fresh start)."""
        if self._given is not None:
            return self._given
        saved = info.meta.get("layout") if info is not None else None
        self._last = resumed_slots(self._spec, self._servers, self._newer(info, saved))
        return self._last

    def _newer(self, info: Optional[Any], saved: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        """The layout to start from: the one kept after ``info``'s, when a change adopted it since
        and ``info``'s files are all in one folder (its rows are re-divided from them); else
        ``info``'s own."""
        kept = self._kept
        if info is None or saved is None or kept is None or int(kept["epoch"]) <= int(saved["epoch"]) \
                or len(kept["owners"]) != len(saved["owners"]):
            return saved
        if any(f"{n}.pt" not in info.files for n in saved["servers"]):
            return saved          # a volume per server: its own file is all it can read
        log.info("a change adopted layout %s after %s (layout %s): starting from it", kept["epoch"], info.id,
                 saved["epoch"])
        return kept

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
