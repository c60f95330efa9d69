"""A step's lookups, staged on the trainers' side: ``plan_lookups`` (pure: deduplicate each
parameter's ids, give each server its share, cut the shares into requests of at most the servers'
``--max-ids-per-request`` ids), the requests issued at once (``PsClient.issue``, whose
``Fetching`` holds the answers on their way), then ``LookupPlan.collect`` (the answers back into
each parameter's batch shape); and gradients of rows not read in a step's context, cut as the
lookups were (``LookupPlan.spread``, pushed by ``StepSession.push``). No RPC here, so the plan is
tested alone."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional

import torch


def on_the_wire(ids: torch.Tensor, id_max: int) -> torch.Tensor:
    """Ids as a request carries them: int32 when no id of the table can pass 2**31 - 1, which
    halves the bytes that name the rows (a hashed table's raw ids stay int64)."""
    return ids.to(torch.int32) if id_max <= torch.iinfo(torch.int32).max else ids


@dataclass
class _Gather:
    shape: torch.Size                 # the parameter's ids as the caller shaped them
    inverse: torch.Tensor             # each id's place among the deduplicated ids
    unique: int                       # how many ids are left, deduplicated
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)   # (request, places in the deduplicated)
    _index: Optional[torch.Tensor] = None

    @property
    def index(self) -> torch.Tensor:
        """Each id's row among the answers' rows laid end to end in piece order: the two
        gathers (answers to deduplicated, deduplicated to ids) made one, so the rows, and in
        backward their gradients, pass through one gather instead of two."""
        if self._index is None:
            if len(self.pieces) == 1 and self.pieces[0][1].numel() == self.unique:
                self._index = self.inverse      # one request holds them all, in order (places rise)
            else:
                order = torch.cat([places for _, places in self.pieces])
                self._index = torch.argsort(order).index_select(0, self.inverse)
        return self._index


@dataclass
class LookupPlan:
    """``requests``: (server index, {parameter: ids}), each naming at most the cap's ids."""

    requests: list[tuple[int, dict[str, torch.Tensor]]]
    _gathers: dict[str, _Gather]
    _row_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def collect(self, answers: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Each parameter's rows [*its ids' shape, *row shape] from the requests' ``answers``, in
        request order. Rows sent in half precision (a table's wire dtype) come back as fp32, which
        the step computes with; their gradient goes back as they came."""
        rows: dict[str, torch.Tensor] = {}
        for param, gather in self._gathers.items():
            if not gather.pieces:          # no id at all (an empty batch of a list column): no request asked
                rows[param] = torch.zeros(*gather.shape, *self._row_shapes[param])
                continue
            parts = [answers[r][param].float() for r, _ in gather.pieces]
            found = parts[0] if len(parts) == 1 else torch.cat(parts)      # deduplicated, piece order
            # index_select, not indexing: its backward adds the gradients up (index_add) a third
            # faster than indexing's accumulating put.
            rows[param] = found.index_select(0, gather.index).view(*gather.shape, *found.shape[1:])
        return rows


    def spread(self, grads: Mapping[str, torch.Tensor]) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The reverse of ``collect``: each parameter's gradients [*its ids' shape, *row shape],
        those of a repeated id added up, cut as the requests were: per request, parameter ->
        (its ids, their gradients), for the server that owns them."""
        pushes: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.requests]
        for param, grad in grads.items():
            gather = self._gathers[param]
            rows = grad.reshape(gather.inverse.numel(), *grad.shape[len(gather.shape):])
            by_unique = rows.new_zeros(gather.unique, *rows.shape[1:]).index_add_(0, gather.inverse, rows)
            for r, places in gather.pieces:
                pushes[r][param] = (self.requests[r][1][param], by_unique[places])
        return pushes


def plan_lookups(lookups: Mapping[str, torch.Tensor], plans: Mapping[str, Any], table_of: Mapping[str, str],
                 max_ids: int, row_shapes: Mapping[str, tuple[int, ...]] | None = None,
                 distinct: Collection[str] = ()) -> LookupPlan:
    """``lookups``: parameter -> ids [...] of its table; ``plans``: each table's sharding plan
    (``ps/spec/sharding.py``); ``table_of``: each parameter's table; ``row_shapes``: each
    parameter's row shape, which a parameter asked for no id at all is collected as; ``distinct``:
    the parameters whose ids are already deduplicated and sorted (a cache's split), which are not
    sorted again. Each server's ids go in as few requests as the cap allows, every parameter of a
    step together."""
    requests: list[tuple[int, dict[str, torch.Tensor]]] = []
    filled: list[int] = []
    open_request: dict[int, int] = {}          # server -> the request being filled for it
    gathers: dict[str, _Gather] = {}
    for param, ids in lookups.items():
        if param in distinct:
            unique, inverse = ids.reshape(-1), torch.arange(ids.numel())
        else:
            unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        plan = plans[table_of[param]]
        gather = gathers[param] = _Gather(ids.shape, inverse, unique.numel())
        for server, (places, shard_ids) in enumerate(plan.partition(unique)):
            for start in range(0, places.numel(), max_ids):      # a share larger than a request: cut
                piece = shard_ids[start:start + max_ids]
                r = open_request.get(server)
                if r is None or filled[r] + piece.numel() > max_ids:
                    r = open_request[server] = len(requests)
                    requests.append((server, {}))
                    filled.append(0)
                # A piece cut from a share fills its request, so no request names a parameter twice.
                requests[r][1][param] = on_the_wire(piece, plan.id_max)
                filled[r] += piece.numel()
                gather.pieces.append((r, places[start:start + max_ids]))
    return LookupPlan(requests, gathers, row_shapes or {})
