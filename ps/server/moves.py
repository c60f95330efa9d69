"""A server's side of a change of layout while it serves (``ps/leader/moves.py`` runs the change).

A change moves slots, and units kept whole, from their old owners to their new ones: each
destination takes the state of what comes to it from its source (``part_of``: the rows of those
slots in every table, with their optimizer state, a hashed table's live ids and bookkeeping, and
the batches' marks) and keeps it aside (``Staged``); then every server of either layout rebuilds
its shard under the new one from its own state and what it took, by the restore's code path
(``ps/server/state.py``'s ``gather_shard``): what left is dropped, what came is in its place. The
rebuild happens behind the ``Gate``, so that no request is inside the server while its tables are
replaced; the leader holds the trainers at a step boundary meanwhile, as a checkpoint does.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

import torch

from ps.spec.rules import by_row
from ps.spec.sharding import Layout, WholePlan, dense_unit, table_unit
from services.remote import call

log = logging.getLogger("ps.server.role")

MOVE_TIMEOUT = 600.0        # seconds a destination waits for the state of what comes to it


class Gate:
    """Requests pass while no change of layout is under way; a change waits for the requests
    inside to finish, and holds new ones until it is done."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False

    def enter(self) -> None:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._inside += 1

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if self._inside == 0:
                self._cond.notify_all()

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._closed = True
            while self._inside:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


def part_of(state: dict[str, Any], layout: Layout, slots: list[int], units: list[str]) -> dict[str, Any]:
    """Of a shard state saved under ``layout`` (``export_state``, or ``held_state``'s live tensors),
    only the rows of ``slots`` and the ``units`` (a table kept whole, ``table:<name>``; a dense
    group, ``dense:<g>``), copied: a shard state ``gather_shard`` reads beside others. Every
    parameter keeps its scalars (a step count)."""
    keep = torch.zeros(layout.slots.count, dtype=torch.bool)
    keep[torch.tensor(slots, dtype=torch.int64)] = True
    wanted = set(units)
    out = {**state, "tables": {}, "params": {}, "optim": {}, "hashed": {}}
    for table, plan in layout.plans.items():
        ids = state["tables"][table]
        if isinstance(plan, WholePlan):
            pick = torch.full((ids.numel(),), table_unit(table) in wanted, dtype=torch.bool)
        else:
            pick = keep[ids % layout.slots.count]
        out["tables"][table] = ids[pick]
        for name in layout.table_params[table]:
            values = state["params"][name]
            out["params"][name] = values[pick]
            saved = state["optim"].get(name)
            if saved:
                rows = by_row(layout.row_state.get(name), saved, values.shape[0])
                out["optim"][name] = {k: v[pick] if k in rows else v.clone() for k, v in saved.items()}
        if table in state.get("hashed", {}):
            out["hashed"][table] = {k: v[pick] if isinstance(v, torch.Tensor) and v.numel() == ids.numel() else v
                                    for k, v in state["hashed"][table].items()}
    for g, names in enumerate(layout.dense_groups):
        if dense_unit(g) in wanted:
            for name in names:
                if name in state["params"]:
                    out["params"][name] = state["params"][name].clone()
                    if name in state["optim"]:
                        out["optim"][name] = {k: v.clone() for k, v in state["optim"][name].items()}
    return out


class Staged:
    """What a destination took for a change of layout, by the epoch it is for, until it rebuilds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[int, list[dict[str, Any]]] = {}

    def take_from(self, source: str, method: Callable[..., Any], slots: list[int], units: list[str],
                  epoch: int) -> int:
        """``source``'s part of ``slots`` and ``units`` (``method``: ``PsSurface.part``), kept for
        ``epoch``; its bytes."""
        started = time.monotonic()
        part = call(source, method, slots, units, timeout=MOVE_TIMEOUT)
        self.add(epoch, part)
        sent = sum(v.numel() * v.element_size() for v in part["params"].values())
        log.info("took %d slots and %d units from %s for layout %d: %d bytes in %.3fs", len(slots), len(units),
                 source, epoch, sent, time.monotonic() - started)
        return sent

    def add(self, epoch: int, part: dict[str, Any]) -> None:
        with self._lock:
            self._parts.setdefault(epoch, []).append(part)

    def take(self, epoch: int) -> list[dict[str, Any]]:
        """The parts for ``epoch``; any for another epoch (a change that failed) are dropped."""
        with self._lock:
            parts, self._parts = self._parts.get(epoch, []), {}
        return parts
