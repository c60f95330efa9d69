"""Delta checkpoints of a shard: what changed since the checkpoint it last saved in, and how a
delta applies to the state it was taken against.

A delta holds the rows of each table that training wrote (an update) or, for a hashed table, read
(a read changes when the row was last seen and how often), by id; the ids hashed tables evicted
(tombstones); the dense tensors whole, and the step. Applied in order to the full state it chains
back to, it gives what a full checkpoint at its step would have saved: every row by id, bit for
bit (``apply_delta``), so a restore, resharded or not, never knows it came from deltas.

``Touched`` keeps one byte a row. A snapshot takes every marked row and leaves it marked *taken*
until its checkpoint is committed (``settle``): a checkpoint that fails, or a leader lost before it
commits, leaves them for the next delta, which then still holds everything since the last commit.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ps.server.hashed.sketch import SKETCH
from ps.server.state import FORMAT, export_shard
from ps.spec.rules import by_row
from ps.spec.sharding import NO_ID

CLEAN, TAKEN, MARKED = 0, 1, 2     # as bits: taking and settling are each one pass


class Touched:
    def __init__(self, tables: dict[str, int], params: dict[torch.Tensor, str]) -> None:
        """``tables``: this shard's rows of each table; ``params``: each table parameter's table."""
        self.marks = {t: torch.zeros(rows, dtype=torch.uint8) for t, rows in tables.items()}
        self._table_of = params
        self._gone: dict[str, list[torch.Tensor]] = {t: [] for t in tables}    # evicted ids since the last take
        self._gone_taken = {t: torch.empty(0, dtype=torch.int64) for t in tables}
        self.since: Optional[int] = None   # the step of the checkpoint the marks count from (None: unknown)
        # Rows written since a change of layout began copying them while training goes on
        # (``track``): what it copies again with the trainers held. None: no copy under way.
        self.moving: Optional[dict[str, torch.Tensor]] = None

    # Under the server's optimizer lock, as every change of the rows is.
    def updated(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        table = self._table_of.get(param)
        if table is not None:
            self.read(table, grad._indices()[0] if grad.is_sparse else slice(None))

    def read(self, table: str, rows: "torch.Tensor | slice") -> None:
        self.marks[table][rows] = MARKED
        if self.moving is not None:
            self.moving[table][rows] = True

    def track(self) -> None:
        """Count the rows written from now on (``moving``), unless it counts already: a change
        that failed leaves them counted, and a count from earlier only sends a row more."""
        if self.moving is None:
            self.moving = {t: torch.zeros(m.numel(), dtype=torch.bool) for t, m in self.marks.items()}

    def evicted(self, table: str, ids: torch.Tensor) -> None:
        if ids.numel():
            self._gone[table].append(ids)

    def take(self, listed: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(each table's rows changed since ``since``, each hashed table's ids evicted since), for
        a snapshot: they stay taken until ``settle``. ``listed``: the rows are wanted (a delta; a
        whole snapshot only takes them)."""
        rows = {}
        for t, marks in self.marks.items():
            if listed:
                rows[t] = marks.nonzero().squeeze(1)
            marks.clamp_(max=TAKEN)           # MARKED -> TAKEN, in one pass
            self._gone_taken[t] = torch.cat([self._gone_taken[t], *self._gone[t]]).unique()
            self._gone[t] = []
        return rows, dict(self._gone_taken)

    def settle(self, committed: bool, step: int) -> None:
        """The checkpoint of the last ``take``, at ``step``, was committed (what it took is saved),
        or not (what it took stays taken, for the next)."""
        if not committed:
            return
        for t, marks in self.marks.items():
            marks.bitwise_and_(MARKED)        # TAKEN -> CLEAN; marked since the take stays MARKED
            self._gone_taken[t] = torch.empty(0, dtype=torch.int64)
        self.since = step


def export_state(server: Any, into: Optional[tuple] = None, since: Optional[int] = None) -> dict[str, Any]:
    """``server``'s shard for a checkpoint, copied at one instant (into ``optimizer.copy_buffers()``'s
    when given); a delta if ``since`` is the step of the checkpoint it last saved in."""
    with server.optimizer.lock:
        # A checkpoint is when hashed tables' rows unseen for long are evicted (trainers are held).
        server.hashed.expire(server.optimizer.steps)
        kept, marks = server.hashed.snapshot(), server.optimizer.marks.snapshot()
        if since is not None and since == server.params.touched.since:
            return export_delta(server, since, server.params.touched.take(), kept)
        server.params.touched.take(listed=False)     # a whole snapshot: the marks' base once committed
    steps, params, state = server.optimizer.state_copy(into)
    return _as_shard(server, steps, params, state, kept, marks)


def held_state(server: Any) -> dict[str, Any]:
    """``server``'s shard as ``export_state`` gives it, but its live tensors themselves, not copies,
    and nothing evicted or taken for a delta: for a change of layout, which runs with the trainers
    held and copies only what it picks (a rebuild behind the server's gate, a part for another
    server), so a shard of gigabytes is not copied whole first."""
    opt = server.optimizer
    with opt.lock:
        kept, marks = server.hashed.snapshot(), opt.marks.snapshot()
        state = [{k: v for k, v in opt.live_state(p).items() if isinstance(v, torch.Tensor)} for p in opt.params]
        return _as_shard(server, opt.steps, [p.detach() for p in opt.params], state, kept, marks, lazy=True)


def _as_shard(server: Any, steps: int, params: list[torch.Tensor], state: list[dict[str, torch.Tensor]],
              kept: dict[str, dict[str, Any]], marks: dict[str, dict[str, Any]], lazy: bool = False) -> dict[str, Any]:
    names = server.params.names
    return export_shard(server.shard, server.layout, server.spec.meta, steps, dict(zip(names, params)),
                        {n: s for n, s in zip(names, state) if s}, kept, marks, lazy)


def export_delta(server: Any, base: int, changed: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                 hashed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``server``'s delta against the checkpoint at step ``base``: copies of each table's rows
    ``changed`` (``Touched.take``: rows, and hashed tables' evicted ids) and their optimizer state,
    the dense tensors whole, and for hashed tables the changed live rows' bookkeeping (``hashed``:
    ``HashedTables.snapshot``). Under the server's optimizer lock."""
    rows, gone = changed
    shard, layout = server.shard, server.layout
    params = {n: server.param(n) for n in server.params.names}
    optim = server.optimizer.live_state
    out_params: dict[str, torch.Tensor] = {}
    out_optim: dict[str, dict[str, torch.Tensor]] = {}
    tables: dict[str, torch.Tensor] = {}
    kept: dict[str, dict[str, Any]] = {}
    row_state: dict[str, list[str]] = {}     # what apply_delta moves with the rows, as the rules say
    for t, plan in layout.plans.items():
        changed = rows[t]
        if t in hashed:
            live = hashed[t]
            pick = server.params.touched.marks[t][live["rows"]] != CLEAN      # the changed among the live
            changed, tables[t] = live["rows"][pick], live["ids"][pick]
            kept[t] = {"last_seen": live["last_seen"][pick], "hits": live["hits"][pick], "counts": live["counts"],
                       "gone": gone[t], **({SKETCH: live[SKETCH]} if SKETCH in live else {})}
        else:
            tables[t] = plan.global_ids(shard)[changed]
        for name in layout.table_params[t]:
            # index_select copies, and at 5x the rows/s of indexing with a tensor
            out_params[name] = params[name].detach().index_select(0, changed)
            state = optim(params[name])
            if state:
                rows_of = by_row(layout.row_state.get(name), state, params[name].shape[0])
                row_state[name] = rows_of
                out_optim[name] = {k: v.index_select(0, changed) if k in rows_of else v.clone()
                                   for k, v in state.items()}
    for name in layout.dense_of(shard):
        out_params[name] = params[name].detach().clone()
        state = optim(params[name])
        if state:
            out_optim[name] = {k: v.clone() for k, v in state.items()}
    return {"format": FORMAT, "delta": {"base": base}, "shard": shard, "num_shards": layout.num_shards,
            "layout": layout.slots.to_dict(), "model": dict(server.spec.meta), "steps": server.optimizer.steps,
            "tables": tables,
            "params": out_params, "optim": out_optim, "row_state": row_state, "hashed": kept,
            "marks": server.optimizer.marks.snapshot(),
            "dense": list(layout.dense_of(shard)),
            "table_params": {t: list(layout.table_params[t]) for t in layout.plans}}


def is_delta(state: dict[str, Any]) -> bool:
    return "delta" in state


def apply_delta(base: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """The full shard state ``delta`` was taken against, ``base``, moved on to ``delta``'s step: a
    new dict (neither input changes), as a full snapshot at that step would have been."""
    if (base["shard"], base["num_shards"]) != (delta["shard"], delta["num_shards"]):
        raise ValueError(f"a delta of shard {delta['shard']} of {delta['num_shards']} cannot apply to shard "
                         f"{base['shard']} of {base['num_shards']}")
    laid = [{k: v for k, v in s["layout"].items() if k != "epoch"} for s in (base, delta) if "layout" in s]
    if len(laid) == 2 and laid[0] != laid[1]:
        raise ValueError(f"a delta under layout {delta['layout']['epoch']} cannot apply to shard {base['shard']} "
                         f"saved under layout {base['layout']['epoch']}, which places other rows there")
    out = {**base, "steps": delta["steps"], "model": delta["model"], "params": dict(base["params"]),
           **({"layout": delta["layout"]} if "layout" in delta else {}),
           "marks": dict(delta.get("marks", base.get("marks", {}))),
           "optim": {n: dict(s) for n, s in base["optim"].items()}, "tables": dict(base["tables"]),
           "hashed": {t: dict(h) for t, h in base.get("hashed", {}).items()}}
    for t, ids in delta["tables"].items():
        old_ids = out["tables"][t]
        if t in delta["hashed"]:
            place = _hashed_place(out, t, ids, delta["hashed"][t])
        else:
            place = functools.partial(_put, at=_positions(old_ids, ids))
        for n in delta["table_params"][t]:
            out["params"][n] = place(out["params"][n], delta["params"][n])
            given = delta["optim"].get(n, {})
            rows_of = by_row(delta.get("row_state", {}).get(n), given, ids.numel())     # none said: an older delta
            for key, value in given.items():
                if key in rows_of:
                    # State that appeared since the base (a first step) is zeros on rows no step touched.
                    old = out["optim"].get(n, {}).get(key)
                    value = place(old if old is not None else value.new_zeros(old_ids.numel(), *value.shape[1:]),
                                  value)
                out["optim"].setdefault(n, {})[key] = value
    for n in delta["dense"]:
        out["params"][n] = delta["params"][n]
        if n in delta["optim"]:
            out["optim"][n] = delta["optim"][n]
    return out


def _positions(old_ids: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Where each of ``ids`` is among a plain shard's rows ``old_ids`` (its columns need not keep
    them rising); -1 for a row of no id (``NO_ID``: a whole tensor's gradient marks every row)."""
    order = torch.argsort(old_ids)
    found = order[torch.searchsorted(old_ids[order], ids).clamp(max=max(old_ids.numel() - 1, 0))]
    return torch.where(ids == NO_ID, -1, found)


def _put(values: torch.Tensor, new: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """A plain table's rows: ``new`` over ``values`` at ``at`` (none where ``at`` is -1)."""
    out = values.to(new.dtype, copy=True)      # the newer precision, if the table's changed between them
    keep = at >= 0
    out[at[keep]] = new[keep]
    return out


def _hashed_place(out: dict[str, Any], table: str, ids: torch.Tensor, change: dict[str, Any]) -> Any:
    """A hashed table: its evicted ids out, its changed ids' rows in place of theirs or added (the
    ids and bookkeeping in ``out`` now; rows of each parameter and its state by the function back)."""
    old_ids = out["tables"][table]
    keep = ~torch.isin(old_ids, change["gone"]) & ~torch.isin(old_ids, ids)
    out["tables"][table] = torch.cat([old_ids[keep], ids])
    book = out["hashed"].setdefault(table, {})
    for k in ("last_seen", "hits"):
        if k in book:
            book[k] = torch.cat([book[k][keep], change[k]])
    book["counts"] = change["counts"]
    if SKETCH in change:        # the sketch whole, as the delta's step left it
        book[SKETCH] = change[SKETCH]
    return lambda values, new: torch.cat([values[keep].to(new.dtype), new])
