"""What a request may name on one shard: table parameters of the model, and ids in range, owned
here, at most ``--max-ids-per-request`` of them. A bad one is a ``BadRequest`` to its caller; one
planned with another layout's epoch that names what this shard does not hold now is ``StaleLayout``
(the caller's copy of the layout is old, not its request wrong)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ps.spec.sharding import Layout
from services.errors import BadRequest, StaleLayout
from services.remote import describe

ID_DTYPES = (torch.int64, torch.int32)   # int32: what the client sends for a table under 2**31 rows


class RequestChecks:
    def __init__(self, layout: Layout, shard: int, max_ids: int, epoch_of_call: Callable[[], int] = lambda: 0,
                 on_stale: Callable[[], None] = lambda: None) -> None:
        """``epoch_of_call``: the layout epoch the request being served was planned with (0: none
        said); ``on_stale``: told of each one refused as planned with another (to count it)."""
        self.layout, self.shard, self.max_ids = layout, shard, max_ids
        self._epoch_of_call, self._on_stale = epoch_of_call, on_stale

    def _stale(self, what: str) -> StaleLayout:
        self._on_stale()
        return StaleLayout(f"{what}: planned with layout {self._epoch_of_call()}, this server serves by layout "
                           f"{self.layout.epoch}; take the leader's", self.layout.epoch)

    def _planned_elsewhere(self) -> bool:
        epoch = self._epoch_of_call()
        return epoch != 0 and epoch != self.layout.epoch

    def same_layout(self, what: str) -> None:
        """A request that depends on this shard's whole part (its dense tensors, an operation
        over its rows) must be planned with this server's layout."""
        if self._planned_elsewhere():
            raise self._stale(what)

    def not_here(self, what: str) -> Exception:
        """What to raise for a request naming what this shard does not hold."""
        if self._planned_elsewhere():
            return self._stale(what)
        return BadRequest(f"{what}: not held by shard {self.shard} of {self.layout.num_shards} "
                          f"(layout {self.layout.epoch})")

    def table_of(self, param: str) -> str:
        try:
            return self.layout.table_of(param)
        except KeyError:
            raise BadRequest(f"no table parameter {param!r}; this model has "
                             f"{', '.join(self.layout.row_params())}") from None

    def ids(self, table: str, ids: Any, what: str, any_shard: bool = False) -> None:
        """``ids`` of ``table``, as one request may name them (``any_shard``: owned by any shard)."""
        plan = self.layout.plans[table]
        if not isinstance(ids, torch.Tensor) or ids.dtype not in ID_DTYPES or ids.dim() != 1:
            raise BadRequest(f"{what} must be an int64 or int32 tensor [n], got {describe(ids)}")
        if ids.numel() == 0:
            raise BadRequest(f"{what} is empty")
        self.count(ids.numel(), what)
        if plan.id_max < torch.iinfo(torch.int64).max:     # a hashed table takes any raw id
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi > plan.id_max:
                raise BadRequest(f"{what} out of range: [{lo}, {hi}] not within [0, {plan.num_ids})")
        if not any_shard and bool((plan.owner(ids) != self.shard).any()):
            raise self.not_here(f"{what} holds ids that shard {self.shard} of {plan.num_shards} does not own")

    def lookups(self, lookups: dict[str, Any]) -> int:
        """A read of rows (table parameter -> ids): the ids it names in all."""
        if not lookups:
            raise BadRequest("lookup_many names no parameter")
        for param, ids in lookups.items():
            self.ids(self.table_of(param), ids, "ids" if len(lookups) == 1 else f"ids of {param}")
        total = sum(ids.numel() for ids in lookups.values())
        self.count(total, "the lookups")
        return total

    def pushed(self, grads: dict[str, Any], dense: dict[str, Any], shape_of: Callable[[str], torch.Size]) -> None:
        """A push's gradients, all of them before any joins a step: each table parameter's ``(ids,
        a row's gradient per id)`` for a plain table, each dense tensor's shaped as it is here."""
        mine = self.layout.dense_of(self.shard)
        for name, grad in dense.items():
            if name not in mine:
                raise self.not_here(f"{name} is no dense tensor of this server (it holds {', '.join(mine) or 'none'})")
            if not isinstance(grad, torch.Tensor) or grad.shape != shape_of(name):
                raise BadRequest(f"the gradient of {name} must be a tensor {list(shape_of(name))}, got {describe(grad)}")
        for param, (ids, grad) in grads.items():
            table = self.table_of(param)
            if table in self.layout.hashed_tables():
                raise BadRequest(f"{param}: gradients of a hashed table's rows are not pushed (its rows change hands)")
            self.ids(table, ids, f"ids of {param}")
            row = shape_of(param)[1:]
            if not isinstance(grad, torch.Tensor) or grad.shape != (ids.numel(), *row):
                raise BadRequest(f"the gradient of {param} must be a tensor [{ids.numel()}, {', '.join(map(str, row))}] "
                                 f"(a row per id), got {describe(grad)}")

    def held(self, param: str, ids: Any, what: str) -> str:
        """Rows the trainers hold (``hold_rows``, ``return_rows``): a plain table's, each named once.
        Their table."""
        table = self.table_of(param)
        if table in self.layout.hashed_tables():
            raise BadRequest(f"{what}: {param} is a hashed table's, whose rows change hands: trainers hold none")
        self.ids(table, ids, f"{what}: ids of {param}")
        if ids.unique().numel() != ids.numel():
            raise BadRequest(f"{what}: ids of {param} name a row twice")
        return table

    def coef(self, coef: Any) -> None:
        """A clip factor: the global norm's scale for a step's gradients."""
        if not 0.0 <= coef <= 1.0:
            raise BadRequest(f"coef must be a float in [0, 1], got {coef!r}")

    def count(self, n: int, what: str) -> None:
        if n > self.max_ids:
            raise BadRequest(f"{what}: {n} ids, more than the {self.max_ids} one request may name "
                             f"(--max-ids-per-request): split it")
