"""A read of rows and dense tensors on its way (``Fetching``), and the rows a read took from the
trainer's cache instead (``Copies``): what a step waits for, adopts when it was read ahead, and
pushes the gradients of (``ps/client/session.py``)."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from ps.client.cache import HotRows, Taken
from ps.client.lookups import LookupPlan
from ps.client.routes import Routes
from services.errors import StaleLayout
from services.remote import wait


class Fetching:
    """Lookups issued and not yet collected: what a step waits for, and where a prefetch or a
    row cache comes in (the plan says which rows each answer holds). Issued outside a step's
    context (a prefetch), the answers carry no way back: a step ``adopt``s them, computes with
    them as its own leaves, and pushes their gradients (``StepSession.finish``)."""

    def __init__(self, plan: LookupPlan, answers: list[torch.futures.Future],
                 dense: list[torch.futures.Future], dense_servers: list[int], copies: Optional[Copies] = None,
                 stamped: bool = False, servers: tuple[str, ...] = (), epoch: int = 0,
                 asked: Optional[dict[str, torch.Tensor]] = None) -> None:
        """``servers``, ``epoch``: the layout the plan's server indices are of (``replanned``);
        ``asked``: every id asked for, those the cache gave among them (for ``UpdateCounts``)."""
        # ``stamped``: each answer is (the server's updates when it read, the rows) (``read_rows``).
        self._stamps: list[Optional[int]] = [None] * len(answers)
        if stamped:
            answers = [f.then(self._unstamp(i)) for i, f in enumerate(answers)]
        self.plan, self._answers, self._dense = plan, answers, dense
        self.servers, self.epoch = servers, epoch
        self._dense_servers = dense_servers      # the server of each dense answer
        self.copies = copies                     # rows taken from the cache
        self.asked = asked or {}
        self.issued_at = time.perf_counter()
        self._landed: list[float] = []       # when each answer came (RPC threads append)
        for f in (*answers, *dense):
            f.add_done_callback(lambda _: self._landed.append(time.perf_counter()))
        self._leaves: Optional[tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]] = None

    def _unstamp(self, i: int) -> Callable[[torch.futures.Future], dict[str, torch.Tensor]]:
        def rows(f: torch.futures.Future) -> dict[str, torch.Tensor]:
            self._stamps[i], answer = f.value()
            return answer
        return rows

    def stamps(self) -> list[tuple[int, int]]:
        """(server, its updates so far when it answered) of each answer stamped and in."""
        return [(k, stamp) for (k, _), stamp in zip(self.plan.requests, self._stamps) if stamp is not None]

    @property
    def has_leaves(self) -> bool:
        """Whether a step computed with tensors of this process from it (adopted, or cache copies)."""
        return self._leaves is not None or self.copies is not None

    def done(self) -> bool:
        """Every answer is in (``collect`` would not wait)."""
        return all(f.done() for f in (*self._answers, *self._dense))

    def hidden(self) -> float:
        """Called as a step begins to wait for the answers: the seconds of the read that passed
        before (from its issue to its last answer, or to now), hidden behind other work."""
        now = time.perf_counter()
        landed = max(self._landed, default=self.issued_at) if self.done() else now
        return max(0.0, min(landed, now) - self.issued_at)

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Wait for the answers: each parameter's rows in its ids' shape, and the dense tensors."""
        return self._assemble([wait(f) for f in self._answers], [wait(f) for f in self._dense])

    def adopted(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``collect``, each answer made a leaf of this process's graph, whose gradients
        ``pushes`` hands back."""
        rows = [{p: t.detach().requires_grad_() for p, t in wait(f).items()} for f in self._answers]
        dense = [{n: t.detach().requires_grad_() for n, t in wait(f).items()} for f in self._dense]
        self._leaves = rows, dense
        return self._assemble(rows, dense)

    def _assemble(self, rows: list[dict[str, torch.Tensor]], dense: list[dict[str, torch.Tensor]]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        weights: dict[str, torch.Tensor] = {}
        for answer in dense:
            weights.update(answer)
        collected = self.plan.collect(rows)
        if self.copies is not None:
            self.copies.assemble(collected, rows)
        return collected, weights

    def pushes(self, grads: dict[torch.Tensor, torch.Tensor]
               ) -> list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]:
        """The adopted leaves' gradients (``grads``: a step context's, by tensor), one message per
        answer as distributed backward sends them: (server, its rows' parameter -> (ids,
        gradients), its dense tensors' name -> gradient). A leaf the loss did not reach has none."""
        out = [] if self.copies is None else self.copies.pushes(grads)
        if self._leaves is not None:
            rows, dense = self._leaves
            out += [(k, {p: (ask[p], grads[t]) for p, t in answer.items() if t in grads}, {})
                    for (k, ask), answer in zip(self.plan.requests, rows)]
            out += [(k, {}, {n: grads[t] for n, t in answer.items() if t in grads})
                    for k, answer in zip(self._dense_servers, dense)]
        return [push for push in out if push[1] or push[2]]


class Copies:
    """The rows a read took from the cache (``taken``, by parameter), read at step ``read_at``:
    put back among the rows read, which the cache then keeps; and the gradients of those taken,
    cut for their servers as ``hits`` plans them."""

    def __init__(self, cache: HotRows, taken: dict[str, Taken], hits: LookupPlan, read_at: int,
                 table_rows: dict[str, int]) -> None:
        self.cache, self.taken, self.hits, self.read_at, self.table_rows = cache, taken, hits, read_at, table_rows
        self._leaves: dict[str, torch.Tensor] = {}

    @classmethod
    def take(cls, cache: HotRows, routes: Routes, lookups: dict[str, torch.Tensor], step: int, read_at: int
             ) -> tuple[Optional["Copies"], dict[str, torch.Tensor]]:
        """What ``cache`` gives of ``lookups`` for step ``step``, planned by ``routes``, and the
        lookups left to read. ``read_at``: the step whose reads the copies stand for (a read
        reflects every step applied before it)."""
        early, _ = routes.pushable(lookups)
        taken = {p: cache.take(p, ids, step) for p, ids in early.items() if ids.numel()}
        if not taken:
            return None, lookups
        left = {p: ids for p, ids in lookups.items() if p not in taken}
        left.update({p: t.miss_ids for p, t in taken.items() if t.miss_ids.numel()})
        hits = routes.plan({p: t.hit_ids for p, t in taken.items() if t.hit_ids.numel()}, distinct=taken)
        return cls(cache, taken, hits, read_at, {p: routes.plans[routes.table_of[p]].num_ids for p in taken}), left

    def assemble(self, rows: dict[str, torch.Tensor], answers: list[dict[str, torch.Tensor]]) -> None:
        """``rows`` (what the plan collected: a cached parameter's as its ``miss_ids``) completed in
        place with the copies taken, each a leaf whose gradient ``pushes`` hands back."""
        for param, taken in self.taken.items():
            read = rows.get(param)
            if read is None:                               # every id taken from the cache
                read = taken.hit_rows[:0]
            else:
                wire = next(a[param] for a in answers if param in a)
                self.cache.store(param, taken.miss_ids, read, self.read_at, self.table_rows[param])
                self.cache.note_row_bytes(param, wire[0].numel() * wire.element_size() if wire.numel() else 0)
            leaf = self._leaves[param] = taken.hit_rows.requires_grad_()
            rows[param] = taken.assemble(leaf, read)
            self.cache.count(param, taken)

    def pushes(self, grads: dict[torch.Tensor, torch.Tensor]) -> list[tuple[int, dict, dict]]:
        """The gradients of the copies taken, for their servers (none for replicas: the trainers
        average and apply those themselves)."""
        got = {p: grads[t] for p, t in self._leaves.items() if t in grads and self.taken[p].hit_ids.numel()}
        if not got or self.cache.replicated:
            return []
        parts = self.hits.spread(got)
        return [(k, part, {}) for (k, _), part in zip(self.hits.requests, parts)]


def earliest(stamps: list[tuple[int, int]]) -> dict[int, int]:
    """By server, the earliest of ``stamps`` (``Fetching.stamps``): when a step first read there."""
    out: dict[int, int] = {}
    for k, stamp in stamps:
        out[k] = min(stamp, out.get(k, stamp))
    return out


# Gradients pushed with a step's norm round or hand-over, per server: its rows' parameter ->
# (ids, gradients), and its dense tensors' name -> gradient (``PsSurface.push``'s arguments).
Pushes = dict[int, tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]


class GradOf:
    """Gradients by tensor as a local backward leaves them (each leaf's ``.grad``), asked as a
    distributed autograd context's are (``dist_autograd.get_gradients``)."""

    def __contains__(self, t: torch.Tensor) -> bool:
        return t.grad is not None

    def __getitem__(self, t: torch.Tensor) -> torch.Tensor:
        if t.grad is None:
            raise KeyError("no gradient")
        return t.grad

    def get(self, t: torch.Tensor, default: Any = None) -> Any:
        return default if t.grad is None else t.grad


def replanned(fetched: "Fetching", pushes: list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                        dict[str, torch.Tensor]]],
              routes: Routes) -> list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]:
    """``fetched``'s ``pushes``, planned by ``routes`` (the client's now): a read planned before a change
    of layout (read ahead across it) sends each row's gradient to the server that owns the row
    now, and each dense tensor's to the server it was read from, by name."""
    if fetched.epoch == routes.epoch or not fetched.servers:
        return pushes
    out = []
    for k, rows, dense in pushes:
        if rows:
            out += spread_by(routes, {p: ids for p, (ids, _) in rows.items()}, {p: g for p, (_, g) in rows.items()})
        if dense:
            name = fetched.servers[k]
            if name not in routes.servers:
                raise StaleLayout(f"dense tensors read from {name}, which the layout no longer names")
            out.append((routes.servers.index(name), {}, dense))
    return out


def spread_by(routes: Routes, lookups: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
              ) -> list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]:
    """The gradients ``grads`` of the rows ``lookups`` names, one push for each server ``routes``
    puts them on."""
    plan = routes.plan(lookups)
    return [(k, part, {}) for (k, _), part in zip(plan.requests, plan.spread(grads))]


def merged(pushes: list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]) -> Pushes:
    """``pushes`` (as ``Fetching.pushes`` gives them) gathered by server: a table's rows from two
    answers (a cut request, a copy) in one, each row once, its gradients summed."""
    out: Pushes = {}
    for k, rows, dense in pushes:
        kept_rows, kept_dense = out.setdefault(k, ({}, {}))
        for param, (ids, grad) in rows.items():
            if param in kept_rows:
                ids, grad = _summed(torch.cat([kept_rows[param][0], ids]), torch.cat([kept_rows[param][1], grad]))
            kept_rows[param] = (ids, grad)
        kept_dense.update(dense)
    return out


def _summed(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's gradients summed where ``ids`` name it more than once: each id once."""
    unique, where = torch.unique(ids, return_inverse=True)
    if unique.numel() == ids.numel():
        return ids, grads
    return unique, torch.zeros((unique.numel(), *grads.shape[1:]), dtype=grads.dtype).index_add_(0, where, grads)
