"""A change of layout copied ahead: most of its copying done while training goes on, so that the
trainers are held only for what changed meanwhile (``ps/server/moves.py`` has the rest).

With the trainers running, each source copies the plain tables' rows of its moving slots (an
*early* part), and each server lays out its shard by the new layout (``laid_out``): the parts
written into the columns its tensors have empty, or, with too few, its shard built aside from its
own live rows and those parts. Neither copy is consistent: rows are written while they are read.
So each server counts, from before its first copy (``Touched.moving``), every row written since;
with the trainers held, a source sends only those rows of the moving slots (its *changes*, with
the hashed tables and dense groups whole, which are not copied ahead), and each server writes its
own such rows and the changes it took over what it laid out (``patched``). A row read torn was written
after its count began, so it is always sent again. What the hold copies is what training wrote
during the copies, not what the servers hold.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ps.server.moves import part_of
from ps.server.state import Gathered, gather_shard
from ps.spec.rules import by_row
from ps.spec.sharding import NO_ID, HashedPlan, Layout, ShardPlan, Slots, dense_unit, table_unit


def plain_tables(layout: Layout) -> list[str]:
    """The tables copied ahead: all but the hashed (whose rows an id's admission moves)."""
    return [t for t, plan in layout.plans.items() if not isinstance(plan, HashedPlan)]


PIECE_ROWS = 1 << 20     # about how many of a source's rows an early part's one transfer covers


def by_rows(layout: Layout, source: int) -> list[list[str]]:
    """The plain tables in pieces of about ``PIECE_ROWS`` rows of ``source``'s (a larger table a
    piece of its own), for an early part taken a piece at a time."""
    pieces: list[list[str]] = [[]]
    rows = 0
    for table in plain_tables(layout):
        here = layout.plans[table].held(source) if source < layout.num_shards else 0
        if pieces[-1] and rows + here > PIECE_ROWS:
            pieces.append([])
            rows = 0
        pieces[-1].append(table)
        rows += here
    return pieces


def every_unit(layout: Layout) -> list[str]:
    """Every table kept whole and every dense group: with every slot, all a server can hold."""
    return [*(table_unit(t) for t in layout.plans), *(dense_unit(g) for g in range(len(layout.dense_groups)))]


def patched(built: Gathered, held: Gathered, layout: Layout, shard: int, changes: list[dict[str, Any]],
            lock: Any = contextlib.nullcontext(), tables: Optional[list[str]] = None) -> Gathered:
    """The plain tables of ``shard`` built aside (``built``, from copies taken while training went
    on), with the rows written since written over theirs (``changes``: parts of only those rows,
    the server's own and each source's), beside what was gathered with the trainers held
    (``held``: hashed tables, dense groups, steps, marks). ``lock``: taken for each few rows
    written (into live tensors, which a whole tensor's update rewrites); ``tables``: only these."""
    params = {**built.params, **held.params}
    optim = {**{n: dict(v) for n, v in built.optim.items()}, **held.optim}
    for table in plain_tables(layout) if tables is None else tables:
        plan = layout.plans[table]
        for change in changes:
            ids = change["tables"].get(table)
            if ids is None or not ids.numel():
                continue
            # The rest live elsewhere now (or nowhere: a row of no id, in a server's own state).
            mine = ((ids != NO_ID) & (plan.owner(ids) == shard)).nonzero().squeeze(1)
            at = plan.to_local(ids[mine])
            for start in range(0, mine.numel(), LOCKED_ROWS):
                part, where = mine[start:start + LOCKED_ROWS], at[start:start + LOCKED_ROWS]
                with lock:
                    for name in layout.table_params[table]:
                        params[name][where] = change["params"][name][part]
                        _write_state(optim.setdefault(name, {}), change, name, where, part, plan.rows(shard))
    return Gathered(params, optim, held.steps, held.hashed, held.marks)


LOCKED_ROWS = 1 << 16     # rows written into live tensors under one taking of the optimizer's lock


def laid_out(own: dict[str, Any], parts: list[dict[str, Any]], layout: Layout, shard: int, lock: Any) -> Gathered:
    """``shard``'s plain tables by ``layout`` from its own live state (``held_state``'s ``own``)
    and the early ``parts``, each row written where its id goes (no search). A table whose storage
    the change keeps (a gridded row-wise table under ``layout``'s columns, ``Columns.after``,
    where every slot that stays keeps its column; a table kept whole that stays) is its own live
    tensors, the parts written into the columns that were empty: no row that stays is copied, and
    training goes on, reading and writing none of those columns. Any other (every row-wise table
    of a server without such columns, a packed one, one kept whole that comes or goes) is built
    aside, with its own rows that stay."""
    kept, aside = [], []
    for table in plain_tables(layout):
        plan, rows = layout.plans[table], own["params"][layout.table_params[table][0]].shape[0]
        same = rows == plan.rows(shard) and (type(plan) is not ShardPlan or (plan.gridded and layout.columns is not None))
        (kept if same else aside).append(table)
    names = {t: layout.table_params[t] for t in aside}
    fresh = {n: own["params"][n].new_zeros(layout.plans[t].rows(shard), *own["params"][n].shape[1:])
             for t in aside for n in names[t]}
    built = patched(Gathered({n: own["params"][n] for t in kept for n in layout.table_params[t]},
                             {n: own["optim"][n] for t in kept for n in layout.table_params[t] if n in own["optim"]},
                             0, {}, {}), NOTHING, layout, shard, parts, lock, tables=kept)
    # Its own rows, as a part says them: which of their optimizer state is by row.
    mine = {**own, "row_state": {n: by_row(layout.row_state.get(n), own["optim"].get(n, {}), own["params"][n].shape[0])
                                 for t in aside for n in names[t]}}
    rest = patched(Gathered(fresh, {}, 0, {}, {}), NOTHING, layout, shard, [mine, *parts], tables=aside)
    return Gathered({**built.params, **rest.params}, {**built.optim, **rest.optim}, 0, {}, {})


NOTHING = Gathered({}, {}, 0, {}, {})


def _write_state(state: dict[str, torch.Tensor], change: dict[str, Any], name: str, at: torch.Tensor,
                 pick: torch.Tensor, rows: int) -> None:
    """``name``'s optimizer state in ``change`` written into ``state`` (of ``rows`` rows): the
    values by row of the change's rows ``pick`` at ``at``, a scalar (a step count) the larger of
    the two, as a restore takes it."""
    by_rows = change.get("row_state", {}).get(name, ())
    for key, value in change["optim"].get(name, {}).items():
        if key in by_rows:
            if key not in state:        # state that appeared since: zeros where no step was, as it makes
                state[key] = value.new_zeros(rows, *value.shape[1:])
            state[key][at] = value[pick]
        elif value.numel() == 1 and key in state and state[key].numel() == 1:
            state[key] = torch.maximum(state[key], value.reshape(state[key].shape))
        else:
            state[key] = value


def built_by(taken: Any, slots: Slots, moving: "dict[str, torch.Tensor] | None") -> bool:
    """Whether a change's rebuild by ``slots`` puts the rows written since into the shard built
    aside (``taken``: ``Staged.take``'s): one was built by these slots, every part was copied
    ahead, and the server counted its rows written (``moving``)."""
    return taken.built is not None and taken.built[0] == slots and not taken.whole and moving is not None


def gathered_now(own: dict[str, Any], was: Layout, moving: "dict[str, torch.Tensor] | None", layout: Layout,
                 shard: int, taken: Any) -> Gathered:
    """What ``shard`` holds by ``layout`` (the new), from its own live state ``own`` (``held_state``,
    under the old layout ``was``; ``moving``: its rows written since its copying began) and what it
    took (``Staged.take``): the shard built aside and the changes since, when everything was copied
    ahead (the leader asks for changes only then); else from the whole parts.

    A count of rows written that a failed change began goes on (only a rebuild ends it), so a
    row written since it began is sent once more, never left out; what that change took and built
    was kept under its own name (``Staged``) and is dropped."""
    if built_by(taken, layout.slots, moving):
        # Its own rows written since, too: into a shard built aside; where it filled its own
        # tensors, onto themselves (a row whose optimizer state appeared since needs it).
        mine = part_of(own, was, list(range(was.slots.count)), every_unit(was), only=moving,
                       tables=plain_tables(was), dense=False)
        hashed = [t for t in layout.plans if t not in plain_tables(layout)]
        held = gather_shard([own, *taken.changes.values()], layout, shard, complete=False, tables=hashed)
        return patched(taken.built[2], held, layout, shard, [mine, *taken.changes.values()])
    return gather_shard([own, *taken.whole.values()], layout, shard, complete=False)
