"""What a model is fed: a batch's sparse features as one jagged tensor per feature, its numeric
columns as one dense tensor, and its labels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch


@dataclass(frozen=True)
class Jagged:
    """One sparse feature of a batch: sample ``i``'s ids are ``values[offsets[i]:offsets[i + 1]]``
    (``offsets`` has one more entry than there are samples; a sample may have no id)."""

    values: torch.Tensor         # [N] int64
    offsets: torch.Tensor        # [B + 1] int64, from 0 to N, not decreasing

    def __post_init__(self) -> None:
        if self.values.dim() != 1 or self.offsets.dim() != 1 or len(self.offsets) < 1:
            raise ValueError(f"a jagged feature needs 1-D values and offsets, got shapes "
                             f"{tuple(self.values.shape)} and {tuple(self.offsets.shape)}")
        if self.values.dtype != torch.int64 or self.offsets.dtype != torch.int64:
            raise ValueError(f"a jagged feature's values and offsets are int64, got {self.values.dtype} "
                             f"and {self.offsets.dtype}")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != len(self.values) \
                or bool((self.offsets[1:] < self.offsets[:-1]).any()):
            raise ValueError(f"a jagged feature's offsets go from 0 to its {len(self.values)} values without "
                             f"decreasing, got {self.offsets.tolist()[:8]}…")

    @classmethod
    def of(cls, lists: Iterable[Sequence[int]]) -> "Jagged":
        """From one list of ids per sample."""
        lists = [list(ids) for ids in lists]
        lengths = torch.tensor([len(ids) for ids in lists], dtype=torch.int64)
        values = torch.tensor([i for ids in lists for i in ids], dtype=torch.int64)
        return cls(values, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))

    @property
    def batch_size(self) -> int:
        """Its samples."""
        return len(self.offsets) - 1

    @property
    def lengths(self) -> torch.Tensor:
        """[B] each sample's count of ids."""
        return self.offsets[1:] - self.offsets[:-1]

    def rows(self, start: int, stop: int) -> "Jagged":
        """Samples ``start`` to ``stop`` (exclusive)."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Jagged(self.values[lo:hi], self.offsets[start:stop + 1] - lo)


@dataclass(frozen=True)
class Batch:
    """``sparse``: feature name -> its ids; ``dense``: [B, numeric columns] float32 (``[B, 0]``
    without any); ``labels``: [B] float32."""

    sparse: Mapping[str, Jagged]
    dense: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        sizes = {name: f.batch_size for name, f in self.sparse.items()}
        sizes.update(dense=self.dense.shape[0], labels=self.labels.shape[0])
        if len(set(sizes.values())) > 1:
            raise ValueError(f"a batch's parts disagree on its size: {sizes}")

    def __len__(self) -> int:
        """Its samples."""
        return int(self.labels.shape[0])

    def rows(self, start: int, stop: int) -> "Batch":
        """Samples ``start`` to ``stop`` (exclusive)."""
        return Batch({name: f.rows(start, stop) for name, f in self.sparse.items()}, self.dense[start:stop],
                     self.labels[start:stop])
