"""What a shard holds of a model (its rows of every table, its dense tensors), and the reusable
buffers big server-side operations compute in."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ps.server.delta import Touched
from ps.spec.precision import dtype_of, is_half

if TYPE_CHECKING:
    from ps.spec.sharding import Layout
    from ps.spec.model import ModelSpec


class RowShard(nn.Module):
    """One table parameter's rows on this shard, [rows, *row shape], looked up by local row, and
    stored in ``dtype`` (default: as given). A half-precision table is read in fp32, its gradient
    recorded on ``stand_in``, an fp32 leaf of its shape that holds no memory (``ps/spec/precision.py``)."""

    def __init__(self, weight: torch.Tensor, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        weight = weight.to(dtype) if dtype is not None else weight
        self.weight = nn.Parameter(weight, requires_grad=not is_half(weight))
        self.stand_in = torch.zeros(()).expand(weight.shape).requires_grad_() if is_half(weight) else None

    def forward(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.stand_in is not None:
            return _HalfRows.apply(self.stand_in, self.weight, local_ids)
        if self.weight.dim() == 2:
            # sparse=True: a step's gradient (and update) touches only the rows it used.
            return F.embedding(local_ids, self.weight, sparse=True)
        return self.weight[local_ids]   # rows of another shape: a dense gradient


class _HalfRows(torch.autograd.Function):
    """Rows of a half-precision table in fp32; their gradient, fp32 and sparse, to its stand-in."""

    @staticmethod
    def forward(ctx: Any, stand_in: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.shape = rows, stand_in.shape
        return weight.index_select(0, rows).float()     # index_select: 5x the rows/s of weight[rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return torch.sparse_coo_tensor(ctx.rows[None], grad, ctx.shape, check_invariants=False), None, None


class ShardParams:
    """One shard's parameters by name: its rows of every table, stored as the table says, and its
    dense groups' tensors."""

    def __init__(self, spec: "ModelSpec", layout: "Layout", shard: int, values: dict[str, torch.Tensor]) -> None:
        self._layout = layout
        tables = {n: spec.tables[layout.table_of(n)] for n in layout.row_params()}
        self.rows = nn.ModuleDict({_key(n): RowShard(values[n], dtype_of(t.dtype)) for n, t in tables.items()})
        self.dense_names = list(layout.dense_of(shard))
        self.dense = nn.ParameterDict({_key(n): nn.Parameter(values[n]) for n in self.dense_names})
        self.names = [*layout.row_params(), *layout.dense_of(shard)]
        self.rules = [spec.rule_of(layout.table_of(n) if n in tables else None) for n in self.names]
        self.wire = {n: dtype_of(t.wire_dtype) for n, t in tables.items()}     # how its rows are sent
        self._by_stand_in = {r.stand_in: r.weight for r in self.rows.values() if r.stand_in is not None}
        # What changed since the last checkpoint, for a delta (``ps/server/delta.py``).
        self.touched = Touched({t: plan.rows(shard) for t, plan in layout.plans.items()},
                               {self[n]: layout.table_of(n) for n in tables})

    def __getitem__(self, name: str) -> nn.Parameter:
        """The live parameter ``name`` (a table's rows on this shard, or a dense tensor)."""
        key = _key(name)
        return self.rows[key].weight if key in self.rows else self.dense[key]

    def dense_copy(self, way_back: bool = True) -> dict[str, torch.Tensor]:
        """Copies of the dense tensors, by name (take them under the optimizer's lock). With
        ``way_back``, an answer in a step's context carries the way back for their gradients, as
        distributed autograd records it; an apply's answer needs none."""
        return {n: self[n].clone() if way_back else self[n].detach().clone() for n in self.dense_names}

    def sparse_grad(self, name: str, ids: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A row per global id of table parameter ``name`` as the sparse fp32 gradient of its rows here."""
        local = self._layout.plans[self._layout.table_of(name)].to_local(ids.long())
        return torch.sparse_coo_tensor(local[None], grad.float(), self[name].shape, check_invariants=False)

    def row_shard(self, name: str) -> RowShard:
        return self.rows[_key(name)]

    def of_tables(self, tables: list[str]) -> dict[str, RowShard]:
        """The rows of these tables' parameters, by name."""
        return {n: self.row_shard(n) for t in tables for n in self._layout.table_params[t]}

    def by_param(self, grads: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """Gradients keyed by the parameters they change (a half-precision table's arrive on its
        stand-in)."""
        return {self._by_stand_in.get(p, p): g for p, g in grads.items()} if self._by_stand_in else grads


def _key(name: str) -> str:
    return name.replace(".", "/")   # module and parameter dicts take no dots in keys


class BufferPool:
    """Reuses large [tokens, rows] buffers between calls of a server-side operation.

    glibc serves allocations over 32 MB with mmap/munmap, so a fresh 46 MB buffer per call costs
    thousands of page faults and cross-core TLB shootdowns; reuse costs nothing. A buffer whose
    backward never comes (its trainer died) is simply garbage-collected.
    """

    def __init__(self, keep: int = 4) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._keep = keep

    def take(self, rows: int, cols: int) -> torch.Tensor:
        need = rows * cols
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            if fits:
                base = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                return base[:need].view(rows, cols)
        return torch.empty(need).view(rows, cols)

    def give(self, buffer: torch.Tensor) -> None:
        base = buffer._base if buffer._base is not None else buffer
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(base.view(-1))
