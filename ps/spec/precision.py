"""Half-precision rows: how a table stored in fp16 or bf16 is read and updated.

A row's update is computed in fp32 and rounded back *stochastically*: up or down to the two
nearest half-precision values, with the odds that make the expected result the exact one
(TorchRec's FBGEMM tables and Monolith do the same). Rounding to nearest would drop every update
smaller than half a step between two half-precision values, and late in training most are.

A half-precision table's gradient stays fp32: autograd casts a leaf's gradient to the leaf's
dtype, so reads of such a table go through a stand-in fp32 leaf of the table's shape that holds
no memory (``RowShard`` in ``ps/server/tables.py``), and the server hands its gradient to the table.
"""
from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}") from None


def is_half(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float16, torch.bfloat16)


# The fp32 mantissa bits each half precision has not: rounding drops them.
_DROPPED = {torch.bfloat16: 16, torch.float16: 13}
_FP16_NORMAL = 2.0 ** -14      # below it, fp16's subnormals keep fewer bits still


def stochastic_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` in ``dtype``, each value rounded to one of its two neighbours there with the
    probability that makes the rounding unbiased: E[result] = x.

    Adding uniform noise below the kept bits to the fp32 pattern and truncating does it in a few
    passes (the pattern is sign and magnitude, so it rounds the magnitude, either sign alike);
    fp16's subnormals, where fewer bits are kept, are rounded between their neighbours instead."""
    dropped = _DROPPED[dtype]
    noise = torch.empty(x.shape, dtype=torch.int32).random_(0, 1 << dropped)
    bits = (x.contiguous().view(torch.int32) + noise).bitwise_and_(-(1 << dropped))
    out = bits.view(torch.float32).to(dtype)
    if dtype == torch.float16:
        small = x.abs() < _FP16_NORMAL
        if bool(small.any()):
            out[small] = _between_neighbours(x[small], dtype)
    return out


def _between_neighbours(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    near = x.to(dtype)
    gap = x - near.float()
    toward = torch.where(gap > 0, torch.full_like(near, float("inf")), torch.full_like(near, float("-inf")))
    other = torch.nextafter(near, toward)
    odds = gap / (other.float() - near.float())     # in [0, 0.5]; nan (never moves) where x is exact
    return torch.where(torch.rand_like(x) < odds, other, near)


def add_rows(param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, alpha: float) -> None:
    """``param[rows] += alpha * values`` (``rows`` distinct; ``values`` fp32), stochastically
    rounded when ``param`` is half precision."""
    if not is_half(param):
        param.index_add_(0, rows, values, alpha=alpha)
        return
    stepped = param.index_select(0, rows).float().add_(values, alpha=alpha)
    param.index_copy_(0, rows, stochastic_round(stepped, param.dtype))
