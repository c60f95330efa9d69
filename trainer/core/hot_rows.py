"""``--cache-staleness 0`` under ``--consistency sync --dense allreduce``: the rows the trainers read
most, replicated among them as Bagpipe keeps its hot embeddings, so that a cached row is exact.

Every trainer of the group holds the same hot rows with their optimizer state. A step takes them
from here, never from the servers; its gradients of them are averaged over the group with the
dense weights' (``DenseReplica``), and each trainer steps them by the table's own rule, as the
servers would have: the replicas stay equal, and a step computes what it would without the cache
(bit for bit where the servers' average and this one add up alike: two trainers, no clipping).
The servers' copies of hot rows stand still until the rows go back to them (``return_rows``):
when they leave the hot set, at a checkpoint, and when a trainer stops.

Which rows are hot is the group's choice every ``every`` steps of the step clock: each trainer
counts the ids its training batches named since the last choice and offers its most named (a
table's capacity of them), the group adds the offers up, and each table keeps the most named
(ties to the lower id), the same on every trainer. Rows that
leave go back to the servers; rows that come are read from them with their state (``hold_rows``).
No RPC or collective of its own: the servers and the group are the caller's (``ServerRows``,
``DenseReplica``), so it is tested alone."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch

from ps.client.cache import HotRows, Taken, others
from ps.client.client import PsClient
from ps.client.routes import Routes
from ps.spec.rules import UpdateRule, rule
from ps.spec.surface import PsSurface
from services.errors import ConfigError
from services.remote import wait

log = logging.getLogger(__name__)

EVERY = 20      # steps between the group's choices of hot rows

Held = dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]   # param -> (ids, rows, state)


@dataclass
class _Rows:
    """One table parameter's hot rows: ``ids`` sorted, ``rows`` a leaf the steps' gradients reach,
    ``state`` the rule's rows of state."""

    ids: torch.Tensor
    rows: torch.Tensor
    state: dict[str, torch.Tensor]


class ServerRows:
    """The servers' side of hot rows: rows with their state read from the servers that own them,
    and written back, one request a server (or as many as ``--max-ids-per-request`` needs), all
    at once."""

    def __init__(self, client: PsClient) -> None:
        self.client = client

    def hold(self, lookups: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Rows [n, *row] and their state of ``lookups`` (parameter -> sorted unique ids)."""
        routes = self.client.routes
        plan = self._plan(routes, lookups)
        answers = [wait(f) for f in [self.client.ask(routes.servers[k], PsSurface.hold_rows, ask, epoch=routes.epoch)
                                     for k, ask in plan.requests]]
        out: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        for (_, ask), answer in zip(plan.requests, answers):
            for param, (rows, state) in answer.items():
                ids = lookups[param]
                if param not in out:
                    out[param] = (rows.new_empty(ids.numel(), *rows.shape[1:]),
                                  {k: v.new_empty(ids.numel(), *v.shape[1:]) for k, v in state.items()})
                at = torch.searchsorted(ids, ask[param].long())      # ``ids`` sorted: each asked id's place
                out[param][0][at] = rows
                for k, v in state.items():
                    out[param][1][k][at] = v
        return out

    def give_back(self, held: Held, step: int) -> None:
        """``held`` rows (by sorted ids) and their state into the servers' tables, as of the step
        clock's ``step``."""
        routes = self.client.routes
        plan = self._plan(routes, {p: ids for p, (ids, _, _) in held.items() if ids.numel()})
        sends = []
        for k, ask in plan.requests:
            sent = {}
            for param, asked in ask.items():
                ids, rows, state = held[param]
                at = torch.searchsorted(ids, asked.long())
                sent[param] = (asked, rows[at], {key: v[at] for key, v in state.items()})
            sends.append(self.client.ask(routes.servers[k], PsSurface.return_rows, sent, step, epoch=routes.epoch))
        for f in sends:
            wait(f)

    def _plan(self, routes: Routes, lookups: dict[str, torch.Tensor]) -> Any:
        """``lookups`` planned by ``routes``: the requests then go to those routes' servers."""
        return routes.plan(lookups, self.client.row_shapes, distinct=tuple(lookups))


@dataclass
class ReplicatedRows(HotRows):
    """Per table parameter at most ``capacity`` rows or ``share`` of its table's, whichever is
    more, chosen every ``every`` steps. ``bind`` gives it the servers and each table's rule."""

    staleness: int = 0
    every: int = EVERY
    replicated: ClassVar[bool] = True
    held: dict[str, _Rows] = field(default_factory=dict)
    _named: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    _servers: Optional[ServerRows] = None
    _rules: dict[str, UpdateRule] = field(default_factory=dict)
    _lr: float = 0.0
    _table_rows: dict[str, int] = field(default_factory=dict)

    def bind(self, servers: ServerRows, rules: dict[str, UpdateRule], lr: float, table_rows: dict[str, int]) -> None:
        """``rules``, ``table_rows``: each table parameter's update rule and its table's rows."""
        self._servers, self._rules, self._lr, self._table_rows = servers, rules, lr, table_rows

    @property
    def rows(self) -> int:
        return sum(h.ids.numel() for h in self.held.values())

    def take(self, param: str, ids: torch.Tensor, used_at: int) -> Taken:
        """The hot rows among ``ids``, as the replica holds them now (the way back for their
        gradients leads to it). A training read's ids are counted for the next choice."""
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        if torch.is_grad_enabled():
            self._named.setdefault(param, []).append((unique, torch.bincount(inverse, minlength=unique.numel())))
        held = self.held.get(param)
        places, hit_rows = unique[:0], torch.zeros(0)
        if held is not None and held.ids.numel():
            at = torch.searchsorted(held.ids, unique).clamp_(max=held.ids.numel() - 1)
            places = (held.ids[at] == unique).nonzero().squeeze(1)
            hit_rows = held.rows.index_select(0, at[places])
        return Taken(ids.shape, inverse, places, unique[places], hit_rows, *others(places, unique), places.new_zeros(0))

    def store(self, param: str, ids: torch.Tensor, rows: torch.Tensor, read_at: int, table_rows: int = 0) -> None:
        """Rows read from the servers are not kept: only the group's choice makes a row hot."""

    def forget(self) -> None:
        """The replica is where hot rows live: a server back from a checkpoint leaves them be."""

    # --- the group's step (``DenseReplica``) ---------------------------------------------------------
    def zero_grad(self) -> None:
        """Before a backward run on the trainer, which adds the hot rows' gradients to their ``.grad``."""
        for h in self.held.values():
            h.rows.grad = None

    def averaged(self, grads: dict[torch.Tensor, torch.Tensor], union: Callable[[torch.Tensor], torch.Tensor],
                 mean: Callable[[torch.Tensor], torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """The group's average of the step's gradients of the hot rows (``grads``: this trainer's,
        the step context's), by the rows (the tensor) each changes. Only rows some member's step
        touched cross: ``union`` takes the group's most of a mask [rows], ``mean`` its average of
        a flat tensor, as Bagpipe all-reduces a step's hot rows, not all it holds."""
        held = [h for _, h in sorted(self.held.items())]
        if not held:
            return {}
        mine = [grads.get(h.rows) for h in held]
        flat = [g.reshape(g.shape[0], -1) if g is not None else None for g in mine]
        touched = union(torch.cat([f.ne(0).any(1) if f is not None else torch.zeros(h.ids.numel(), dtype=torch.bool)
                                   for h, f in zip(held, flat)]))
        cut = torch.split(touched, [h.ids.numel() for h in held])
        sent = [f[t] if f is not None else h.rows.new_zeros(int(t.sum()), h.rows[0].numel())
                for h, f, t in zip(held, flat, cut)]
        got = torch.split(mean(torch.cat([x.reshape(-1) for x in sent])), [x.numel() for x in sent])
        out = {}
        for h, t, g in zip(held, cut, got):
            whole = h.rows.new_zeros(h.rows.shape)
            whole.view(h.ids.numel(), -1)[t] = g.view(-1, h.rows[0].numel())
            out[h.rows] = whole
        return out

    @torch.no_grad()
    def apply(self, averaged: dict[torch.Tensor, torch.Tensor], coef: float) -> None:
        """Each table's rule on its hot rows (``averaged``: what ``averaged`` gave, among others),
        over the rows the group's gradient touched: a sparse gradient, as the servers step a table."""
        for param, h in self.held.items():
            grad = averaged[h.rows]
            if coef < 1.0:
                grad = grad * coef
            touched = grad.reshape(grad.shape[0], -1).ne(0).any(1).nonzero().squeeze(1)
            if touched.numel():
                # Rows in order, each once: coalesced as it is, which spares the rule a sort.
                sparse = torch.sparse_coo_tensor(touched[None], grad[touched], h.rows.shape, check_invariants=False,
                                                 is_coalesced=True)
                self._rules[param].step(h.rows, sparse, h.state, self._lr)

    def choose(self, step: int, gather: Callable[[Any], list[Any]], writes: bool) -> bool:
        """At the step clock's ``step``, every ``every`` steps: the group's hot rows chosen anew
        (``gather``: every member's object, in rank order, the same on every member). Rows that
        leave go back to the servers (by this member if it ``writes``), rows that come are read.
        Whether it chose."""
        if step % self.every or self._servers is None:
            return False
        started = time.perf_counter()
        mine = {p: self._counted(p) for p in sorted(self._named)}
        self._named.clear()
        counted: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for theirs in gather(mine):
            for param, pair in theirs.items():
                counted.setdefault(param, []).append(pair)
        leaving: Held = {}
        coming: dict[str, torch.Tensor] = {}
        kept: dict[str, _Rows] = {}
        for param in sorted(set(counted) | set(self.held)):
            chosen = self._top(counted.get(param, []), self.capacity_of(self._table_rows.get(param, 0)))
            h = self.held.get(param) or _Rows(chosen[:0], torch.zeros(0), {})
            stays = torch.isin(h.ids, chosen)
            if not bool(stays.all()):
                gone = (~stays).nonzero().squeeze(1)
                leaving[param] = (h.ids[gone], h.rows.detach()[gone], {k: v[gone] for k, v in h.state.items()})
            kept[param] = _Rows(h.ids[stays], h.rows.detach()[stays], {k: v[stays] for k, v in h.state.items()})
            new = chosen[~torch.isin(chosen, h.ids)]
            if new.numel():
                coming[param] = new
        if leaving:
            if writes:
                self._servers.give_back(leaving, step)
            # Every member waits for the write: a member's next reads (read ahead, they go out
            # right after this) must find the rows that left as the group left them.
            gather(None)
        read = self._servers.hold(coming) if coming else {}
        merged = {p: self._merged(kept[p], coming.get(p), read.get(p)) for p in kept}
        self.held = {p: h for p, h in merged.items() if h.ids.numel()}
        log.info("hot rows at step %d: %d held, %d came, %d left (%.0f ms)", step, self.rows,
                 sum(c.numel() for c in coming.values()), sum(ids.numel() for ids, _, _ in leaving.values()),
                 1000 * (time.perf_counter() - started))
        return True

    def give_back(self, step: int) -> None:
        """Every hot row and its state into the servers' tables (a checkpoint, a stop), as of ``step``."""
        if self._servers is not None and self.held:
            self._servers.give_back({p: (h.ids, h.rows.detach(), h.state) for p, h in self.held.items()}, step)

    def state(self) -> dict[str, Any]:
        """What a newcomer to the group takes (``load``): the hot rows, their ids and state."""
        return {p: (h.ids.clone(), h.rows.detach().clone(), {k: v.clone() for k, v in h.state.items()})
                for p, h in self.held.items()}

    def load(self, state: dict[str, Any]) -> None:
        self.held = {p: _Rows(ids, rows.requires_grad_(), dict(s)) for p, (ids, rows, s) in state.items()}

    def _counted(self, param: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids this trainer's batches named since the last choice, and how often: the table's
        capacity of them at most, the most named, which is what this member offers the group."""
        ids, counts = _summed(self._named[param])
        keep = self.capacity_of(self._table_rows.get(param, 0))
        if ids.numel() > keep:
            top = _ranked(counts)[:keep]
            ids, counts = ids[top], counts[top]
        return ids, counts

    @staticmethod
    def _top(pairs: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> torch.Tensor:
        """The ``capacity`` ids named most over every member's counts, sorted by id."""
        if not pairs or capacity <= 0:
            return torch.zeros(0, dtype=torch.long)
        ids, counts = _summed(pairs)
        return ids[_ranked(counts)[:capacity]].sort().values

    @staticmethod
    def _merged(kept: _Rows, ids: Optional[torch.Tensor], read: Optional[tuple]) -> _Rows:
        """The rows that stay and those read (``ids``, ``read``: their rows and state), by id: a
        new leaf, as a step's gradients must reach the rows it took."""
        if ids is None:
            return _Rows(kept.ids, kept.rows.clone().requires_grad_(), kept.state)
        rows, state = read
        rows = rows.detach()
        if not kept.ids.numel():
            return _Rows(ids, rows.clone().requires_grad_(), state)
        order = torch.argsort(torch.cat([kept.ids, ids]))
        return _Rows(torch.cat([kept.ids, ids])[order], torch.cat([kept.rows, rows])[order].requires_grad_(),
                     {k: torch.cat([kept.state[k], state[k]])[order] for k in state})


def table_rules(model: dict[str, Any]) -> dict[str, UpdateRule]:
    """Each table parameter's update rule, as the servers' model names it (``ModelSpec.meta``)."""
    tables = model.get("restorable", {}).get("tables", {})
    if not tables:
        raise ConfigError("--cache-staleness 0 steps hot rows by their tables' rules, but the servers' model "
                          "names none (its ModelSpec.meta['restorable'])")
    return {param: rule(t["rule"]) for param, t in tables.items()}


def row_cache(capacity: int, staleness: int, share: float = 0.0) -> Optional[HotRows]:
    """The cache the flags ask for: none for 0 rows and a share of 0; hot rows replicated among
    the trainers for staleness 0 (which needs ``--dense allreduce``); else copies."""
    if capacity <= 0 and share <= 0:
        return None
    return ReplicatedRows(capacity, 0, share) if staleness == 0 else HotRows(capacity, staleness, share)


def _summed(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, counts) pairs added up: each id once, sorted, with its counts' sum."""
    ids, inverse = torch.unique(torch.cat([i for i, _ in pairs]), return_inverse=True)
    return ids, torch.zeros(ids.numel(), dtype=torch.long).index_add_(0, inverse, torch.cat([c for _, c in pairs]))


def _ranked(counts: torch.Tensor) -> torch.Tensor:
    """Places of sorted ids' ``counts`` from the most counted down, ties to the lower id."""
    return torch.sort(counts, descending=True, stable=True).indices
