"""A server's side of a change of layout while it serves (``ps/leader/moves.py`` runs the change).

A change moves slots, and units kept whole, from their old owners to their new ones: each
destination takes the state of what comes to it from its source (``part_of``: the rows of those
slots in every table, with their optimizer state, a hashed table's live ids and bookkeeping, and
the batches' marks) and keeps it aside (``Staged``); then every server of either layout rebuilds
its shard under the new one from its own state and what it took, by the restore's code path
(``ps/server/state.py``'s ``gather_shard``): what left is dropped, what came is in its place. The
rebuild happens behind the ``Gate``, so that no request is inside the server while its tables are
replaced; the leader holds the trainers at a step boundary meanwhile, as a checkpoint does. Most
of the copying is done before that hold, while training goes on (``ps/server/precopy.py``).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Collection, Iterator, NamedTuple, Optional

import torch

from ps.server.hashed.sketch import SKETCH
from ps.server.state import Gathered
from ps.spec.rules import by_row
from ps.spec.sharding import NO_ID, Columns, Layout, Slots, WholePlan, dense_unit, table_unit
from services.errors import BadRequest
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


def part_of(state: dict[str, Any], layout: Layout, slots: list[int], units: list[str],
            only: Optional[dict[str, torch.Tensor]] = None, tables: Optional[Collection[str]] = None,
            dense: bool = True) -> dict[str, Any]:
    """Of a shard state saved under ``layout`` (``export_state``, or ``held_state``'s live tensors),
    only the rows of ``slots`` and the ``units`` (a table kept whole, ``table:<name>``; a dense
    group, ``dense:<g>``), copied: a shard state ``gather_shard`` reads beside others. Every
    parameter keeps its scalars (a step count). ``only``: of a plain table, only the rows marked
    there (those written since an early copy, ``Touched.moving``); ``tables``: only these tables
    (None: all); not ``dense``: without the dense groups (an early copy leaves them, and the
    hashed tables, to the hold)."""
    keep = torch.zeros(layout.slots.count, dtype=torch.bool)
    keep[torch.tensor(slots, dtype=torch.int64)] = True
    wanted = set(units) if dense else {u for u in units if not u.startswith("dense:")}
    out = {**state, "tables": {}, "params": {}, "optim": {}, "hashed": {}, "row_state": {}}
    for table, plan in layout.plans.items():
        is_hashed = table in state.get("hashed", {})
        if tables is not None and table not in tables:
            continue
        def of_part(ids: torch.Tensor) -> torch.Tensor:     # which of ``ids`` the part holds
            return torch.full((ids.numel(),), table_unit(table) in wanted, dtype=torch.bool) \
                if isinstance(plan, WholePlan) else keep[ids % layout.slots.count]
        if only is not None and not is_hashed:
            # The few rows written since: picked by position, not by a pass over every row.
            pick = only[table].nonzero().squeeze(1)
            ids = plan.ids_at(state["shard"], pick)
            inside = of_part(ids) & (ids != NO_ID)
            pick, ids = pick[inside], ids[inside]
        else:
            ids = state["tables"][table]
            pick = of_part(ids) if is_hashed else of_part(ids) & (ids != NO_ID)    # a raw id may be -1
            ids = ids[pick]
        out["tables"][table] = ids
        for name in layout.table_params[table]:
            values = state["params"][name]
            out["params"][name] = values[pick]
            saved = state["optim"].get(name)
            if saved:
                rows = by_row(layout.row_state.get(name), saved, values.shape[0])
                out["row_state"][name] = rows
                out["optim"][name] = {k: v[pick] if k in rows else v.clone() for k, v in saved.items()}
        if is_hashed:
            live = state["tables"][table].numel()
            # By row, but the sketch (whose counters no slot owns): whole.
            out["hashed"][table] = {k: v[pick] if isinstance(v, torch.Tensor) and v.numel() == live and k != SKETCH
                                    else v for k, v in state["hashed"][table].items()}
    for g, names in enumerate(layout.dense_groups):
        if dense_unit(g) in wanted:
            for name in names:
                if name in state["params"]:
                    out["params"][name] = state["params"][name].clone()
                    if name in state["optim"]:
                        out["optim"][name] = {k: v.clone() for k, v in state["optim"][name].items()}
    return out


def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Parts of one source, of other tables each (``part_of``'s ``tables``), as one."""
    out = {**parts[0], **{k: dict(parts[0][k]) for k in ("tables", "params", "optim", "hashed", "row_state")}}
    for part in parts[1:]:
        for key in ("tables", "params", "optim", "hashed", "row_state"):
            out[key].update(part[key])
    return out


class Taken(NamedTuple):
    """What a server took for a change of layout, by source: whole parts, or early parts and the
    changes since (``ps/server/precopy.py``); and its shard built aside from them (None: not built)."""
    whole: dict[str, dict[str, Any]]
    early: dict[str, dict[str, Any]]
    changes: dict[str, dict[str, Any]]
    built: Optional[tuple[Slots, Optional[Columns], Gathered]]     # and the layout and columns it was built by


STAGES = ("all", "early", "changes")


class Staged:
    """What a server took and built for a change of layout, kept for that attempt at it (named by
    the leader: ``ps/leader/moves.py``'s ``change_name``) until it rebuilds. Anything kept for
    another is of an attempt that failed, or whose leader was lost, and is dropped: a failed
    attempt and the next have the same epoch, and parts of both mixed would leave rows out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._change = ""
        self._taken = Taken({}, {}, {}, None)

    def take_from(self, source: str, method: Callable[..., Any], slots: list[int], units: list[str],
                  change: str, stage: str = "all", pieces: Optional[list[list[str]]] = None) -> int:
        """``source``'s part of ``slots`` and ``units`` (``method``: ``MoveSurface.part``) at
        ``stage``, kept for ``change``; the bytes sent. ``pieces``: taken a few tables at a time,
        these, so that no one transfer holds the receiving process's copying thread for long (a
        trainer's request waits behind it)."""
        if stage not in STAGES:
            raise BadRequest(f"a part's stage is one of {', '.join(STAGES)}, not {stage!r}")
        if stage == "changes" and source not in self.taken(change).early:
            raise BadRequest(f"no early part of {source} for change {change} to bring up to date")
        started = time.monotonic()
        part = merged([call(source, method, slots, units, stage, piece, timeout=MOVE_TIMEOUT)
                       for piece in pieces or [None]])
        sent = self.keep(change, source, stage, part)
        log.info("took %s of %d slots and %d units from %s for change %s: %d bytes in %.3fs", stage, len(slots),
                 len(units), source, change, sent, time.monotonic() - started)
        return sent

    def keep(self, change: str, source: str, stage: str, part: dict[str, Any]) -> int:
        """``source``'s ``part`` at ``stage`` kept for ``change``; its bytes, rows and optimizer state."""
        with self._lock:
            taken = self._for(change)
            {"all": taken.whole, "early": taken.early, "changes": taken.changes}[stage][source] = part
            if stage == "all":      # everything again: what it took ahead is of no use
                taken.early.pop(source, None)
                taken.changes.pop(source, None)
        tensors = [*part["params"].values(), *(v for state in part["optim"].values() for v in state.values())]
        return sum(v.numel() * v.element_size() for v in tensors)     # rows and their state (counts included)

    def keep_built(self, change: str, slots: Slots, columns: Optional[Columns], built: Gathered) -> None:
        with self._lock:
            self._taken = self._for(change)._replace(built=(slots, columns, built))

    def taken(self, change: str) -> Taken:
        with self._lock:
            return self._for(change)

    def take(self, change: str) -> Taken:
        """What it took for ``change``, given up (a rebuild uses it once)."""
        with self._lock:
            taken, self._taken, self._change = self._for(change), Taken({}, {}, {}, None), ""
        return taken

    def _for(self, change: str) -> Taken:
        if change != self._change:
            self._change, self._taken = change, Taken({}, {}, {}, None)
        return self._taken
