"""A server's hashed tables: a request's raw ids to rows, rows initialised as they are handed out,
and gradients for rows that changed hands since they were read dropped.

A lookup of an id without a row (not admitted yet) gives zeros and no way back for a gradient.
An id's row may be evicted and handed to another id between a trainer's read and its update (an
async trainer reads, another trainer's lookup evicts): the update then keeps only the gradient
rows whose ids still own them, so no id ever takes another's gradient. All of it runs under the
server's optimizer lock, which orders lookups and updates.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch

from services.remote import in_autograd_context
from ps.server.delta import Touched
from ps.server.hashed.rows import HashedRows, sketch_width, warm_up
from ps.server.hashed.sketch import SKETCH
from ps.spec.sharding import Layout
from ps.spec.model import ModelSpec
from ps.server.tables import RowShard

log = logging.getLogger("ps.server.service")


class Read(NamedTuple):
    """What a step read of one hashed parameter: its rows, their ids then, and the table's
    eviction round then (no eviction since: nothing can have changed hands)."""

    rows: torch.Tensor
    ids: torch.Tensor
    round: int


class HashedTables:
    def __init__(self, spec: ModelSpec, layout: Layout, shard: int, shards: dict[str, RowShard],
                 clear_state: Any, touched: Touched) -> None:
        """``shards``: this shard's rows of the hashed tables' parameters, by name;
        ``clear_state(param, rows)``: zero the optimizer's state of those rows
        (``SharedOptimizer.clear_rows``); ``touched``: told the rows a training read changed
        (when each was seen) and the ids evicted, for delta checkpoints."""
        self.spec, self.layout, self.shards, self._clear_state = spec, layout, shards, clear_state
        self.touched = touched
        self.cut = False             # a restore left saved rows out (over capacity)
        self.params = {n: s.weight for n, s in shards.items()}
        self.tables = {t: HashedRows(layout.plans[t].rows(shard), spec.tables[t].hashed,
                                     sketch_width(layout.plans[t].num_ids))
                       for t in layout.hashed_tables()}
        if self.tables:
            warm_up()
        self.stale_rows = 0          # gradient rows dropped: their ids lost the row since the read

    def __contains__(self, table: str) -> bool:
        return table in self.tables

    def lookup(self, table: str, param: str, ids: torch.Tensor, step: int, training: bool = True
               ) -> tuple[torch.Tensor, Read]:
        """Rows [n, *row shape] of ``param`` at raw ``ids`` [n] (distinct), zeros for ids without
        a row, and what was read; ``training``: a step's read, which admits, evicts and counts
        (else only existing rows are read). Under the optimizer lock."""
        rows = self.tables[table]
        ids = ids.to(torch.int64)
        found = rows.resolve(ids, step) if training else rows.peek(ids)
        if found.fresh_rows.numel():
            self._fresh(table, found.fresh_rows, found.fresh_ids)
        # Every id has a row, as a trained table's lookups mostly find: no filtering, which would
        # cost a tenth of the lookup.
        every = bool((found.rows >= 0).all())
        known = None if every else (found.rows >= 0).nonzero().squeeze(1)
        if training:
            self.touched.read(table, found.rows if known is None else found.rows[known])
            self.touched.evicted(table, found.evicted_ids)
        shard = self.shards[param]
        if known is None:
            return shard(found.rows), Read(found.rows, ids, rows.evict_rounds)
        # Ids without a row read zeros, which carry no gradient anywhere.
        read = shard(found.rows[known])
        out = torch.zeros(ids.numel(), *read.shape[1:], dtype=read.dtype).index_put((known,), read)
        return out, Read(found.rows[known], ids[known], rows.evict_rounds)

    def read(self, table: str, param: str, ids: torch.Tensor, step: int, note: Callable[[Read], None]
             ) -> torch.Tensor:
        """``lookup`` for a request: only a training step's read (in an autograd context) admits,
        evicts and counts, and ``note(read)`` keeps what it read; an evaluation changes nothing."""
        training = in_autograd_context()
        found, read = self.lookup(table, param, ids, step, training)
        if training:
            note(read)
        return found

    def keep_current(self, reads: dict[str, Read]) -> Callable[[dict], dict]:
        """``keep`` for ``SharedOptimizer.apply``: gradients without the rows whose ids lost them
        since ``reads``."""
        return lambda grads: self.current(grads, reads) if reads else grads

    def _fresh(self, table: str, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """New rows start as the table's ``init`` says for their ids, with no optimizer state."""
        values = self.spec.tables[table].init(ids)
        with torch.no_grad():
            for name in self.layout.table_params[table]:
                self.params[name][rows] = values[name].to(self.params[name].dtype)
                self._clear_state(self.params[name], rows)

    def current(self, grads: dict[torch.Tensor, torch.Tensor], reads: dict[str, Read]
                ) -> dict[torch.Tensor, torch.Tensor]:
        """``grads`` without the rows whose ids no longer own them. Under the optimizer lock."""
        out = dict(grads)
        for param, read in reads.items():
            rows = self.tables[self.layout.table_of(param)]
            grad = grads.get(self.params[param])
            if grad is None or rows.evict_rounds == read.round:
                continue
            owned = read.rows[rows.index.live[read.rows] & (rows.index.keys[read.rows] == read.ids)]
            grad = grad.coalesce()
            keep = torch.isin(grad.indices()[0], owned)
            self.stale_rows += int((~keep).sum())
            out[self.params[param]] = torch.sparse_coo_tensor(grad.indices()[:, keep], grad.values()[keep],
                                                               grad.shape, check_invariants=False).coalesce()
        return out

    def expire(self, step: int) -> dict[str, torch.Tensor]:
        """Evict every table's rows unseen for its ``evict_after_steps`` (at a checkpoint); the
        ids evicted, per table. Under the optimizer lock."""
        gone = {t: rows.expire(step) for t, rows in self.tables.items()}
        for t, ids in gone.items():
            self.touched.evicted(t, ids)
        return gone

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per table, for a checkpoint: live ``rows``, their ``ids``, ``last_seen``, ``hits``, the
        ``counts`` so far, and with admission the ``sketch``'s counters (of ids not admitted yet).
        Under the optimizer lock."""
        out = {}
        for t, rows in self.tables.items():
            ids, live = rows.index.rows()
            out[t] = {"rows": live, "ids": ids, "last_seen": rows.last_seen[live].clone(),
                      "hits": rows.hits[live].clone(), "counts": dict(vars(rows.counts))}
            if rows.sketch is not None:
                out[t][SKETCH] = rows.sketch.counts.clone()
        return out

    def restore(self, saved: dict[str, dict[str, Any]]) -> None:
        """Rows from a checkpoint (``ps/server/state.py``'s ``Gathered.hashed``): the ids, in rows 0, 1, ...,
        where their values already are."""
        for t, kept in saved.items():
            rows = self.tables[t]
            if kept.get("over_capacity"):
                self.cut = True
                log.warning("hashed table %s: %d saved rows more than this server's %d: the least used of them "
                            "were left out, as the table evicts at capacity", t, kept["over_capacity"], rows.capacity)
            placed = rows.index.insert(kept["ids"])
            if "last_seen" in kept:
                rows.last_seen[placed] = kept["last_seen"]
                rows.hits[placed] = kept["hits"]
            for k, v in kept.get("counts", {}).items():
                setattr(rows.counts, k, v)
            # Saved by a server of another sketch width (an older rpcps): its ids are counted afresh.
            sketch = kept.get(SKETCH)
            if rows.sketch is not None and sketch is not None and sketch.shape == rows.sketch.counts.shape:
                rows.sketch.counts = sketch.clone()
            rows.counts.evicted += kept.get("over_capacity", 0)

    def describe(self) -> dict[str, dict[str, Any]]:
        """Per table: rows, capacity, occupancy, admitted, evicted, pending (about how many ids
        were seen but not admitted), dropped lookups, unique ids per training request, bytes a row
        (its values, optimizer state aside, and its bookkeeping, the delta checkpoints' mark too)."""
        out = {}
        for t, rows in self.tables.items():
            values = sum(self.params[n][0].numel() * self.params[n].element_size()
                         for n in self.layout.table_params[t])
            c = rows.counts
            out[t] = {"rows": len(rows), "capacity": rows.capacity, "occupancy": len(rows) / rows.capacity,
                      "admitted": c.admitted, "evicted": c.evicted, "pending": rows.pending(), "dropped": c.dropped,
                      "unique_per_request": c.looked_up / c.requests if c.requests else 0.0,
                      "bytes_per_row": values + rows.nbytes / rows.capacity + self.touched.marks[t].element_size()}
        return out
