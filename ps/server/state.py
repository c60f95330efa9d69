"""A server shard's state as a plain dict for checkpoints, and resharding on restore; pure.

Each table's rows are stored with their global ids, and each state names the layout it was saved
under (``ps/spec/sharding.py``'s ``Slots``), so a checkpoint taken under one layout restores under
any other, over any number of servers: each new shard gathers the ids it owns from every old shard.
A shard whose layout did not change takes its own state as it is. Optimizer
state with a value per row (Adagrad's per value, row-wise Adagrad's per row) is resharded the same
way; dense groups move whole. A hashed table saves only its live rows, by raw id, with when each
was last seen and how often (``ps/server/hashed/``); a shard restores the ids it owns into its first rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection, Iterator, Mapping, NamedTuple, Optional

import torch

from ps.server.hashed.sketch import SKETCH, added
from ps.server.marks import gather_marks
from ps.spec.rules import by_row
from ps.spec.sharding import NO_ID, HashedPlan, Layout, Slots

if TYPE_CHECKING:
    from ps.spec.model import ModelSpec

FORMAT = 1


class ShardIds(Mapping):
    """Each table's ids on a shard, as ``export_shard`` lists them, a plain table's made when first
    asked for: a change of layout's hold reads few of them, and each is a pass over its rows."""

    def __init__(self, layout: Layout, shard: int, hashed: dict[str, dict[str, Any]]) -> None:
        self._layout, self._shard = layout, shard
        self._made = {t: kept["ids"] for t, kept in hashed.items()}

    def __getitem__(self, table: str) -> torch.Tensor:
        if table not in self._made:
            self._made[table] = self._layout.plans[table].global_ids(self._shard)
        return self._made[table]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.plans)

    def __len__(self) -> int:
        return len(self._layout.plans)


def export_shard(shard: int, layout: Layout, model: dict, steps: int, params: dict[str, torch.Tensor],
                 optim_state: dict[str, dict[str, torch.Tensor]],
                 hashed: Optional[dict[str, dict[str, Any]]] = None,
                 marks: Optional[dict[str, dict[str, Any]]] = None, lazy: bool = False) -> dict[str, Any]:
    """``params``/``optim_state`` must already be private copies (taken under the server's lock).
    ``hashed``: each hashed table's live ``rows``, their ``ids`` and bookkeeping (``last_seen``,
    ``hits``, ``counts``), taken under the same lock; only those rows are saved, by id. ``marks``:
    the trainers' batches the parameters hold (``ps/server/marks.py``). ``lazy``: the tables'
    ids made as they are read (``ShardIds``; not for a file)."""
    hashed = hashed or {}
    tables: Mapping[str, torch.Tensor] = ShardIds(layout, shard, hashed)
    if not lazy:
        tables = {t: tables[t] for t in layout.plans}
    params, optim_state = dict(params), {n: dict(st) for n, st in optim_state.items()}
    for t, kept in hashed.items():
        for name in layout.table_params[t]:
            rows_of = params[name].shape[0]
            params[name] = params[name][kept["rows"]]
            state = optim_state.get(name, {})
            for key in by_row(layout.row_state.get(name), state, rows_of):
                optim_state[name][key] = state[key][kept["rows"]]
    return {"format": FORMAT, "shard": shard, "num_shards": layout.num_shards, "layout": layout.slots.to_dict(),
            "model": dict(model), "steps": steps,
            "tables": tables, "params": params, "optim": optim_state, "marks": dict(marks or {}),
            "table_params": {t: list(layout.table_params[t]) for t in layout.plans},
            "hashed": {t: {k: v for k, v in kept.items() if k not in ("rows", "ids")} for t, kept in hashed.items()}}


def same_layout(state: dict[str, Any], layout: Layout) -> bool:
    """Whether ``state`` was saved under ``layout``'s servers and slots (a state from before slots
    names only its server count: its slots were the first layout's)."""
    saved = state.get("layout")
    if saved is None:
        first = Slots.even(layout.num_shards, layout.slots.count)
        return state["num_shards"] == layout.num_shards and layout.slots.owners == first.owners
    return (saved["servers"] == list(layout.slots.servers) and saved["owners"] == list(layout.slots.owners)
            and saved.get("homes", {}) == dict(layout.slots.homes))


def _ids(state: dict[str, Any], table: str, layout: Layout) -> torch.Tensor:
    if "tables" in state:
        return state["tables"][table]
    # Written before tables had names (one table, the language model's vocabulary).
    if len(layout.plans) != 1:
        raise ValueError("a shard saved with one unnamed table cannot restore a model of several tables")
    return state["global_ids"]


class Gathered(NamedTuple):
    params: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]]
    steps: int
    hashed: dict[str, dict[str, Any]]      # per hashed table: ids (in rows 0, 1, ...), last_seen, hits, counts
    marks: dict[str, dict[str, Any]]       # per trainer, its newest batch the shard holds (``ps/server/marks.py``)


def gather_shard(states: list[dict[str, Any]], layout: Layout, shard: int, complete: bool = True,
                 tables: Optional[Collection[str]] = None, dense: bool = True) -> Gathered:
    """Params, optimizer state, steps applied and hashed tables' rows of ``shard`` under
    ``layout``, from every old shard (or from its own, when the cluster kept its shape). Not
    ``complete``: ``states`` are a live server's own and the parts it took for a change of layout
    (``ps/server/moves.py``), which must hold every row ``shard`` owns. ``tables``: only these
    tables' rows (None: all); not ``dense``: without the dense groups."""
    if not states:
        raise ValueError("no shard states to restore from")
    own = len(states) == 1 and states[0]["shard"] == shard and same_layout(states[0], layout)
    if complete and not own and sorted(s["shard"] for s in states) != list(range(states[0]["num_shards"])):
        raise ValueError(f"need every old shard 0..{states[0]['num_shards'] - 1}, got {sorted(s['shard'] for s in states)}")
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    hashed: dict[str, dict[str, Any]] = {}
    for table, plan in layout.plans.items():
        if tables is not None and table not in tables:
            continue
        if isinstance(plan, HashedPlan):
            hashed[table] = _gather_hashed(states, table, layout, plan.rows(shard),
                                           (plan.owner(_ids(states[0], table, layout)) == shard) if own else None,
                                           shard, params, optim)
        elif own and torch.equal(_ids(states[0], table, layout), plan.global_ids(shard)):
            # The same layout and columns: this shard's own rows, as saved (the caller's to keep).
            for name in layout.table_params[table]:
                params[name] = states[0]["params"][name]
                if name in states[0]["optim"]:
                    optim[name] = dict(states[0]["optim"][name])
        else:
            # (its own state by other columns, too: a server that restarts keeps its ids rising)
            pick = _rows_here(states, table, layout, plan.global_ids(shard), plan.num_ids, complete and not own)
            for name in layout.table_params[table]:
                params[name] = _take([s["params"][name] for s in states], pick)
                _gather_rows_state(states, name, pick, optim, layout.row_state.get(name))
    for name in layout.dense_of(shard) if dense else ():
        holder = [s for s in states if name in s["params"]]
        if len(holder) != 1:
            raise ValueError(f"dense parameter {name} found in {len(holder)} old shards, expected 1")
        params[name] = holder[0]["params"][name] if own else holder[0]["params"][name].clone()
        if name in holder[0]["optim"]:
            optim[name] = {k: v if own else v.clone() for k, v in holder[0]["optim"][name].items()}
    return Gathered(params, optim, max(int(s["steps"]) for s in states), hashed, gather_marks(states))


def _gather_hashed(states: list[dict[str, Any]], table: str, layout: Layout, capacity: int,
                   mine: Optional[torch.Tensor], shard: int, params: dict[str, torch.Tensor],
                   optim: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """A hashed table's rows this shard owns, from every old shard, in rows 0 .. m-1 of its
    ``capacity`` (``mine``: which saved rows are this shard's, when it restores its own file)."""
    ids = torch.cat([_ids(s, table, layout) for s in states])
    pick = mine.nonzero().squeeze(1) if mine is not None else \
        (layout.plans[table].owner(ids) == shard).nonzero().squeeze(1)
    kept = [s.get("hashed", {}).get(table, {}) for s in states]
    over = pick.numel() - capacity
    if over > 0:
        # Ids do not spread evenly over a new server count (nor into a smaller capacity): this shard
        # leaves out what its table would evict at capacity, the least used, then the longest unseen.
        if all("hits" in kp for kp in kept):
            hits, seen = (torch.cat([kp[k] for kp in kept])[pick].to(torch.int64) for k in ("hits", "last_seen"))
            pick = pick[torch.sort(hits * (1 << 32) + seen, stable=True).indices[over:]].sort().values
        else:
            pick = pick[:capacity]
    for name in layout.table_params[table]:
        saved = torch.cat([s["params"][name] for s in states])
        params[name] = saved.new_zeros(capacity, *saved.shape[1:])
        params[name][:pick.numel()] = saved[pick]
        for key in _gather_rows_state(states, name, pick, optim, layout.row_state.get(name)):
            value = optim[name][key]
            optim[name][key] = torch.cat([value, value.new_zeros(capacity - pick.numel(), *value.shape[1:])])
    out = {"ids": ids[pick], "over_capacity": max(over, 0),
           **{k: torch.cat([kp[k] for kp in kept])[pick] for k in ("last_seen", "hits") if all(k in kp for kp in kept)}}
    # Ids not admitted yet are known only to the sketches, which cannot be cut by slot: every one
    # given is added in (the counts of ids that live elsewhere only add to collisions).
    sketch = added([kp[SKETCH] for kp in kept if SKETCH in kp])
    if sketch is not None:
        out[SKETCH] = sketch
    if mine is not None:     # its own counts go on; a resharded shard's start again
        out["counts"] = dict(kept[0].get("counts", {}))
    return out


def _rows_here(states: list[dict[str, Any]], table: str, layout: Layout, wanted: torch.Tensor,
               rows: int, complete: bool = True) -> torch.Tensor:
    """Positions, in the old shards' rows laid end to end, of the global ids ``wanted`` (not
    ``complete``: the states hold some of the table's rows, ``wanted`` among them)."""
    ids = torch.cat([_ids(s, table, layout) for s in states])
    held = (ids != NO_ID).nonzero().squeeze(1)      # a row of no id (``NO_ID``) is left out
    ids = ids[held]
    if complete and (ids.numel() != rows or not torch.equal(torch.sort(ids).values, torch.arange(rows))):
        raise ValueError(f"the old shards hold {ids.numel()} {table} rows, this model has {rows}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise ValueError(f"the shards given hold {table} ids outside [0, {rows})")
    where = torch.full((rows + 1,), -1, dtype=torch.long)       # the last: where NO_ID finds no row
    where[ids] = held
    found = where[torch.where(wanted == NO_ID, rows, wanted)]
    lacking = int(((found < 0) & (wanted != NO_ID)).sum())
    if not complete and lacking:
        raise ValueError(f"the shards given lack {lacking} of the {int((wanted != NO_ID).sum())} {table} rows "
                         f"this shard owns")
    return found


def _take(pieces: list[torch.Tensor], pick: torch.Tensor) -> torch.Tensor:
    """The rows ``pick`` of ``pieces`` laid end to end, as a new tensor, without laying them end to
    end first: a change of layout gathers a whole shard this way, and one copy less of it is most
    of what the rebuild costs. A row picked -1 (one that holds no id) is zeros."""
    holes = pick < 0
    if len(pieces) == 1 and not bool(holes.any()):
        return pieces[0][pick]                    # indexing by positions copies
    out = pieces[0].new_empty((pick.numel(), *pieces[0].shape[1:]))
    out[holes] = 0
    start = 0
    for piece in pieces:
        inside = ((pick >= start) & (pick < start + piece.size(0))).nonzero().squeeze(1)
        out[inside] = piece[pick[inside] - start]
        start += piece.size(0)
    return out


def _gather_rows_state(states: list[dict[str, Any]], name: str, pick: torch.Tensor,
                       optim: dict[str, dict[str, torch.Tensor]], row_state: Optional[tuple[str, ...]]) -> list[str]:
    """``name``'s optimizer state for the saved rows ``pick`` of every old shard, into ``optim``;
    ``row_state``: which values are indexed by rows, as its rule says (None: by their shape). The
    keys gathered by row."""
    keys = set().union(*(s["optim"].get(name, {}).keys() for s in states))
    if not keys:
        return []
    optim[name] = {}
    by_rows = []
    for key in sorted(keys):
        # A shard whose rows never took a step has no state yet: zeros, as its first step would make.
        given = [s["optim"].get(name, {}).get(key) for s in states]
        k = next(i for i, p in enumerate(given) if p is not None)
        like = given[k]
        if by_row(row_state, {key: like}, states[k]["params"][name].size(0)):
            parts = [p if p is not None else like.new_zeros((s["params"][name].size(0), *like.shape[1:]))
                     for p, s in zip(given, states)]
            optim[name][key] = _take(parts, pick)
            by_rows.append(key)
        elif like.numel() == 1:  # scalars such as Adagrad's step count: the largest is the truest
            optim[name][key] = torch.stack([p.reshape(()) for p in given if p is not None]).max().clone()
        else:       # a value of the whole parameter, not of its rows: every shard kept its own; the first's
            optim[name][key] = like.clone()
    return by_rows



INIT_ROWS = 1 << 20  # rows of a table initialised at once


def initial_shard(spec: "ModelSpec", layout: Layout, shard: int) -> dict[str, torch.Tensor]:
    """A new shard's parameters: its rows of every table (only its own: no process ever builds a
    whole table) and its dense groups, as the spec initialises them."""
    values: dict[str, torch.Tensor] = {}
    for table_name, table in spec.tables.items():
        if table.hashed:      # rows are initialised as ids are admitted
            for name, shape in table.params.items():
                values[name] = torch.zeros(layout.plans[table_name].rows(shard), *shape)
            continue
        rows = layout.plans[table_name].global_ids(shard)
        for name, shape in table.params.items():
            values[name] = torch.empty(len(rows), *shape)
        for start in range(0, len(rows), INIT_ROWS):       # a slice at a time: bounded temporaries
            ids = rows[start:start + INIT_ROWS]
            at = (ids != NO_ID).nonzero().squeeze(1)
            part = table.init(ids[at])
            for name in table.params:
                piece = values[name][start:start + ids.numel()]
                if at.numel() == ids.numel():
                    piece.copy_(part[name])
                else:                   # a row of no id is zeros
                    piece.zero_()
                    piece[at] = part[name]
    for g in layout.groups_of(shard):
        values.update(spec.dense[g].init())
    return values
