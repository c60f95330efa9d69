"""Embedding tables as one module: declared from ``TableConfig``s, fed a batch's jagged features,
giving each feature's pooled vector.

The same module runs whole in one process, where each table is a parameter of its own, and,
unchanged, with its tables on the parameter servers, where it holds no rows: each step the
trainer fetches the rows the batch names and hands them to it (``trainer/core/hosted.py``).
Either way a table's initial row ``i`` is a function of (seed, table, ``i``), so both start equal.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ps.spec.hashing import hashed, name_key, uniform
from ps.spec.rules import choices as rule_choices
from rpcps.batch import Jagged

INIT_SLICE = 1 << 20      # rows of a table built at a time in one process


class TableConfig(BaseModel):
    """One embedding table: its rows, their width, how a feature's bag of rows is pooled, and
    how the servers store and update it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the table's name, an identifier")
    rows: Optional[int] = Field(None, ge=1, description="its rows; a hashed table's capacity; a vocabulary's most "
                                                       "rows (none: a row for each value counted, and row 0)")
    dim: int = Field(ge=1, description="the width of a row")
    features: tuple[str, ...] = Field((), description="the features that look it up (none: the one named as "
                                                      "the table); features sharing a table share its rows")
    pooling: Literal["sum", "mean"] = Field("sum", description="how a bag of rows becomes one vector")
    rule: Optional[rule_choices()] = Field(  # type: ignore[valid-type]  # the registry's names
        None, description="its update rule (none: the tables' default, `rpcps up --table-rule`; in one process "
                          "`local_optimizer`'s `table_rule`, else the model's optimizer)")
    hashed: bool = Field(False, description="keyed by raw 64-bit ids, which get rows as they come, within "
                                            "its capacity, instead of by ids 0 .. rows - 1")
    vocabulary: bool = Field(False, description="each value the training data names at least `min_count` times "
                                                "gets a row of its own, the most named first, up to `rows` - 1 "
                                                "when `rows` is given; any other value, and one never seen, reads "
                                                "row 0 (`rpcps up` counts the values and records them in `values`; "
                                                "the initial scale is the values' count's, whatever `rows` is)")
    min_count: int = Field(1, ge=1, description="vocabulary: the times a value must be named to get its row")
    values: Optional[tuple[str, ...]] = Field(None, description="vocabulary: the values of rows 1, 2, ..., as "
                                                                "`rpcps up` recorded them (a role started alone "
                                                                "needs them written here)")
    admit_after: int = Field(1, ge=1, description="hashed: requests an id must appear in before it gets a row")
    evict_after_steps: int = Field(0, ge=0, description="hashed: rows unseen this many steps are evicted first "
                                                        "(0: age alone evicts nothing)")
    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="how the servers store its rows")
    wire_dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="how its rows and their "
                                                                            "gradients cross the wire")
    placement: Literal["auto", "row_wise", "table_wise"] = Field(
        "auto", description="row by row over every server, or whole on one (auto: by size)")
    init_scale: Optional[float] = Field(None, gt=0, description="initial rows are uniform in ± this "
                                                                "(none: 1 / sqrt(rows); a vocabulary's: 1 / sqrt "
                                                                "of its values and row 0)")

    @model_validator(mode="before")
    @classmethod
    def _sized_by_values(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("vocabulary") and data.get("rows") is None \
                and data.get("values") is not None:
            data = {**data, "rows": sized(len(data["values"]))}
        return data

    @model_validator(mode="after")
    def _features_distinct(self) -> "TableConfig":
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"table {self.name} names a feature twice: {list(self.features)}")
        if self.rows is None and not self.vocabulary:
            raise ValueError(f"table {self.name}: give its rows (only a vocabulary sizes itself, from its values)")
        if self.vocabulary and self.hashed:
            raise ValueError(f"table {self.name}: a vocabulary gives values rows 1 .. rows - 1, a hashed table keys "
                             f"rows by raw ids: choose one")
        if self.vocabulary and self.rows is not None and self.rows < 2:
            raise ValueError(f"table {self.name}: a vocabulary needs 2 rows at least (row 0 for values outside it)")
        if self.values is not None:
            if not self.vocabulary:
                raise ValueError(f"table {self.name}: `values` are a vocabulary's: say `vocabulary: true`")
            if len(self.values) > self.rows - 1:
                raise ValueError(f"table {self.name}: {len(self.values)} values, at most rows - 1 = {self.rows - 1}")
            if len(set(self.values)) != len(self.values):
                raise ValueError(f"table {self.name}: `values` names a value twice")
        return self

    @property
    def looked_up_by(self) -> tuple[str, ...]:
        return self.features or (self.name,)

    @property
    def scale(self) -> float:
        if self.init_scale is not None:
            return self.init_scale
        if self.vocabulary:        # the values counted size it, not a cap on them
            return 1.0 / math.sqrt(sized(len(self.counted)))
        return 1.0 / math.sqrt(self.rows)

    @property
    def counted(self) -> tuple[str, ...]:
        """A vocabulary's values; a ``ValueError`` before they are counted."""
        if self.values is None:
            raise ValueError(f"table {self.name} takes its vocabulary from the data, which rpcps up counts: it has no "
                             f"values yet")
        return self.values


def sized(values: int) -> int:
    """The rows of a vocabulary of ``values``: one each, and row 0 for every other value."""
    return max(2, values + 1)


class EmbeddingBags(nn.Module):
    """Tables, each looked up by one or more features; ``forward(features)`` takes a batch's
    ``{feature: Jagged}`` and gives ``{feature: [B, dim]}``: the pooled rows of each sample's ids
    (zeros for a sample without any). ``seed`` chooses the initial rows.

    In one process a plain table is the parameter ``weights.<table>`` [rows, dim] with sparse
    gradients; a hashed one gives raw ids rows in arrival order up to its capacity (one process
    admits every id at once and evicts none). Its rows are built at the first forward, or by
    ``materialize()``, so a model whose tables the servers hold never builds them."""

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0) -> None:
        super().__init__()
        self.configs: dict[str, TableConfig] = {}
        self.table_of: dict[str, str] = {}           # feature -> its table
        for cfg in tables:
            if cfg.name in self.configs:
                raise ValueError(f"two tables are named {cfg.name}")
            self.configs[cfg.name] = cfg
            for feature in cfg.looked_up_by:
                if feature in self.table_of:
                    raise ValueError(f"feature {feature} is looked up in tables {self.table_of[feature]} and "
                                     f"{cfg.name}: a feature has one table")
                self.table_of[feature] = cfg.name
        if not self.configs:
            raise ValueError("EmbeddingBags needs one table at least")
        self.seed = seed
        self.weights = nn.ParameterDict()
        self._slots: dict[str, dict[int, int]] = {}            # a hashed table's raw id -> row, in one process
        self._read_only: set[str] = set()                      # hashed tables loaded trained: no new rows
        self._served: Optional[Mapping[str, torch.Tensor]] = None

    def initial_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``table`` as initialised (raw ids, for a hashed table): uniform in
        ± its ``scale``, each a function of (seed, table, id)."""
        cfg = self.configs[table]
        dims = np.arange(cfg.dim, dtype=np.int64)[None, :]
        u = uniform(hashed(self.seed, name_key(table), ids.numpy().astype(np.int64)[:, None], dims))
        return torch.from_numpy((2.0 * u - 1.0) * cfg.scale).to(torch.float32)

    def materialize(self) -> "EmbeddingBags":
        """Build every table's rows here, to train in one process."""
        if self._served is not None:
            raise RuntimeError("this module's tables are on the parameter servers")
        for name, cfg in self.configs.items():
            if name in self.weights:
                continue
            weight = torch.zeros(cfg.rows, cfg.dim)
            if cfg.hashed:
                self._slots[name] = {}
            else:
                for start in range(0, cfg.rows, INIT_SLICE):
                    ids = torch.arange(start, min(cfg.rows, start + INIT_SLICE))
                    weight[start:start + len(ids)] = self.initial_rows(name, ids)
            self.weights[name] = nn.Parameter(weight)
        return self

    def load_rows(self, table: str, rows: torch.Tensor, ids: Optional[torch.Tensor] = None) -> None:
        """Trained rows in place of ``table``'s (an exported model's, ``rpcps.load_model``): a plain
        table's [rows, dim]; a hashed table's for raw ``ids``, after which it is read-only: an id
        without a row reads zeros, as the servers' evaluation reads one, and none is given a row."""
        cfg = self.configs[table]
        if rows.dim() != 2 or rows.shape[1] != cfg.dim or (not cfg.hashed and rows.shape[0] != cfg.rows):
            raise ValueError(f"table {table} has {'up to ' if cfg.hashed else ''}{cfg.rows} rows of {cfg.dim}, "
                             f"got {tuple(rows.shape)}")
        if cfg.hashed:
            if ids is None or ids.shape != (rows.shape[0],):
                raise ValueError(f"hashed table {table}: give the raw id of each of its {rows.shape[0]} rows")
            self._slots[table] = {int(i): k for k, i in enumerate(ids.tolist())}
            self._read_only.add(table)
            rows = torch.cat([rows, rows.new_zeros(1, cfg.dim)])     # the last: an unknown id's zeros
        self.weights[table] = nn.Parameter(rows.float().clone())

    def lookups(self, features: Mapping[str, Jagged]) -> dict[str, torch.Tensor]:
        """Per table, the ids its features name, one feature after another in its order."""
        self._check(features)
        out = {}
        for name, cfg in self.configs.items():
            ids = torch.cat([features[f].values for f in cfg.looked_up_by])
            self._in_range(name, ids)
            out[name] = ids
        return out

    def forward(self, features: Mapping[str, Jagged]) -> dict[str, torch.Tensor]:
        self._check(features)
        if self._served is not None:
            return self._pool_served(features)
        if len(self.weights) < len(self.configs):
            self.materialize()
        pooled = {}
        for name, cfg in self.configs.items():
            for feature in cfg.looked_up_by:
                f = features[feature]
                if cfg.hashed:
                    ids = self._slots_of(name, f.values)
                else:
                    ids = f.values
                    self._in_range(name, ids)
                pooled[feature] = F.embedding_bag(ids, self.weights[name], f.offsets, mode=cfg.pooling,
                                                  sparse=True, include_last_offset=True)
        return pooled

    def _check(self, features: Mapping[str, Jagged]) -> None:
        if not self.table_of.keys() <= features.keys():
            missing = sorted(set(self.table_of) - set(features))
            raise KeyError(f"the batch has no feature {', '.join(missing)} (it has {', '.join(sorted(features))})")

    def _in_range(self, table: str, ids: torch.Tensor) -> None:
        """A plain table's ids are its rows' (a hashed table takes any)."""
        cfg = self.configs[table]
        if cfg.hashed or not len(ids):
            return
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= cfg.rows:
            bad = ids[(ids < 0) | (ids >= cfg.rows)][0]
            raise ValueError(f"table {table} has rows 0 .. {cfg.rows - 1}, but its features "
                             f"{', '.join(cfg.looked_up_by)} name id {int(bad)}")

    def _pool_served(self, features: Mapping[str, Jagged]) -> dict[str, torch.Tensor]:
        pooled = {}
        for name, cfg in self.configs.items():
            rows = self._served[name]
            wanted = sum(len(features[f].values) for f in cfg.looked_up_by)
            if rows.shape[0] != wanted:
                raise RuntimeError(f"table {name}: {rows.shape[0]} rows served for {wanted} ids")
            start = 0
            for feature in cfg.looked_up_by:
                f = features[feature]
                pooled[feature] = pool(rows[start:start + len(f.values)], f, cfg.pooling)
                start += len(f.values)
        return pooled

    def _slots_of(self, table: str, raw: torch.Tensor) -> torch.Tensor:
        """A hashed table's rows for raw ids in one process: new ids take the next free row."""
        slots, cfg = self._slots[table], self.configs[table]
        unique, inverse = torch.unique(raw, return_inverse=True)
        if table in self._read_only:
            unknown = len(slots)                   # ``load_rows``'s row of zeros
            return torch.tensor([slots.get(i, unknown) for i in unique.tolist()], dtype=torch.int64)[inverse]
        new = [i for i in unique.tolist() if i not in slots]
        if len(slots) + len(new) > cfg.rows:
            raise RuntimeError(f"hashed table {table} is full: {cfg.rows} rows (in one process no row is evicted)")
        if new:
            first = len(slots)
            slots.update((raw_id, first + k) for k, raw_id in enumerate(new))
            with torch.no_grad():
                self.weights[table][first:first + len(new)] = self.initial_rows(table, torch.tensor(new))
        return torch.tensor([slots[i] for i in unique.tolist()], dtype=torch.int64)[inverse]

    def rows_of(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """In one process: the current rows of ``ids`` (raw ids, for a hashed table; an id it has
        not seen gets its initial row), without changing anything."""
        if table not in self.weights:
            return self.initial_rows(table, ids)
        if not self.configs[table].hashed:
            return self.weights[table].detach()[ids]
        slots = self._slots[table]
        out = self.initial_rows(table, ids)
        seen = [k for k, i in enumerate(ids.tolist()) if i in slots]
        if seen:
            out[seen] = self.weights[table].detach()[[slots[ids[k].item()] for k in seen]]
        return out


def pool(rows: torch.Tensor, feature: Jagged, pooling: str) -> torch.Tensor:
    """[N, D] the rows of a feature's ids -> [B, D], each sample's summed or averaged."""
    lengths = feature.lengths
    if rows.shape[0] == feature.batch_size and bool((lengths == 1).all()):
        return rows      # one id a sample (a one-hot column): its row is its bag, summed or averaged
    owner = torch.repeat_interleave(torch.arange(feature.batch_size), lengths)
    out = rows.new_zeros(feature.batch_size, rows.shape[1]).index_add(0, owner, rows)
    return out / lengths.clamp(min=1).unsqueeze(1).to(out.dtype) if pooling == "mean" else out


def bags_of(model: nn.Module) -> Iterator[tuple[str, EmbeddingBags]]:
    """(the parameter-name prefix, the module) of every ``EmbeddingBags`` in ``model``."""
    for path, module in model.named_modules():
        if isinstance(module, EmbeddingBags):
            yield (f"{path}." if path else ""), module


@contextmanager
def serving(bags: Sequence[tuple[EmbeddingBags, Mapping[str, torch.Tensor]]]) -> Iterator[None]:
    """Within: each module pools the rows it is given (table -> the rows of its ``lookups``, in
    their order), fetched from the servers, instead of rows of its own."""
    for bag, rows in bags:
        bag._served = rows
    try:
        yield
    finally:
        for bag, _ in bags:
            bag._served = None
