"""Where a serving member's model comes from, and what it says of what it serves: an exported
folder (``Snapshot``), or the live servers through a cache of rows (``Online``)."""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from ps.client.client import PsClient
from ps.spec.surface import PsSurface
from rpcps.data.criteo import table_sizes
from rpcps.data.statistics import measured
from rpcps.saved import load_model
from rpcps.schema import Schema
from services.errors import ConfigError, PeerUnavailable, StaleLayout
from trainer.core.hosted import table_param
from trainer.ctr.custom import SchemaModel, hosted_module
from trainer.ctr.serving.rows import CriteoRows, RowFormat, SchemaRows


@dataclass(frozen=True)
class Served:
    """What answered a pass: the source, the checkpoint and step (when one is known), and the
    Unix time of the newest update it reflects."""

    source: str
    checkpoint: Optional[str]
    step: Optional[int]
    updated_at: float

    def age(self, now: Optional[float] = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.updated_at)

    def described(self) -> dict[str, Any]:
        return {**asdict(self), "age_s": round(self.age(), 3)}

    def header(self) -> str:
        """The ``X-Rpcps-Served`` header: ``snapshot step-40`` (a checkpoint), ``online step 812``
        (the updates ps0 had applied when the dense weights were read)."""
        if self.checkpoint is not None:
            return f"{self.source} {self.checkpoint}"
        return self.source if self.step is None else f"{self.source} step {self.step}"


class Source(Protocol):
    rows: RowFormat
    model_ref: str
    cache: Optional["RowCache"]         # online: the rows read from the servers

    def answer(self, rows: list[Any]) -> tuple[list[float], Served]: ...
    def served(self) -> Served: ...


def row_format(schema: Schema, described: dict[str, Any], max_rows: int) -> RowFormat:
    """How a request's rows become the model's batches: as its trainers read their files (the
    built-in DLRM's, Criteo's format; any other model's, its schema's)."""
    criteo = described.get("criteo")
    if criteo is None:
        return SchemaRows(schema, max_rows)
    return CriteoRows(table_sizes(criteo["cardinalities"], criteo["hashed"]), max_rows)


class Snapshot:
    """An exported model (``rpcps export``), all in memory: the rows a request names are read from
    its tables as the servers' evaluation read them, and never change."""

    def __init__(self, folder: Path, max_rows: int) -> None:
        if not folder.is_dir():
            raise ConfigError(f"--snapshot {folder}: no such folder (rpcps export --out writes one)")
        try:
            self.model = load_model(folder)
        except ValueError as exc:           # its sentence names the folder
            raise ConfigError(f"--snapshot {exc}") from None
        exported = self.model.exported
        try:
            self.rows = row_format(self.model.schema, exported, max_rows)
        except ConfigError as exc:
            raise ConfigError(f"--snapshot {folder}: {exc}") from None
        self.model_ref = exported["model"]
        self.cache = None
        self._served = Served("snapshot", exported["checkpoint"], exported["step"],
                              float(exported.get("taken_at", exported["exported_at"])))

    def answer(self, rows: list[Any]) -> tuple[list[float], Served]:
        batch = self.rows.batch(rows)
        with torch.no_grad():
            return torch.sigmoid(self.model(batch)).tolist(), self._served

    def served(self) -> Served:
        return self._served


class RowCache:
    """Rows read from the servers, by table parameter and id, each with the time it was read; at
    most ``capacity`` rows, the least recently read dropped first. Used from the batcher's thread
    alone."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: dict[str, "OrderedDict[int, tuple[float, torch.Tensor]]"] = {}
        self.size = self.hits = self.misses = 0

    def split(self, param: str, ids: torch.Tensor, since: float) -> tuple[dict[int, tuple[float, torch.Tensor]],
                                                                          torch.Tensor]:
        """Of the distinct ``ids``, the rows read at ``since`` or later, and the ids to read."""
        kept = self._rows.get(param, {})
        found, missing = {}, []
        for i in ids.tolist():
            entry = kept.get(i)
            if entry is not None and entry[0] >= since:
                found[i] = entry
            else:
                missing.append(i)
        self.hits += len(found)
        self.misses += len(missing)
        return found, torch.tensor(missing, dtype=torch.int64)

    def put(self, param: str, ids: torch.Tensor, rows: torch.Tensor, at: float
            ) -> dict[int, tuple[float, torch.Tensor]]:
        """``rows`` of ``ids``, read at ``at``; the entries, by id."""
        kept = self._rows.setdefault(param, OrderedDict())
        entries = {}
        for i, row in zip(ids.tolist(), rows):
            if i not in kept:
                self.size += 1
            kept[i] = entries[i] = (at, row)
            kept.move_to_end(i)
        while self.size > self.capacity:
            oldest = min(self._rows.values(), key=lambda d: next(iter(d.values()))[0] if d else float("inf"))
            oldest.popitem(last=False)
            self.size -= 1
        return entries


class Online:
    """The live servers' model, read through a ``RowCache``: a row or the dense weights answer
    for ``staleness`` seconds from the moment their read was sent, then are read again. Reads
    change nothing on the servers (outside a training step a hashed table neither admits nor
    counts an id). A read that fails (a server gone, or slower than the client's timeout) fails the
    pass with ``PeerUnavailable``: nothing older than the bound is ever served."""

    def __init__(self, client: PsClient, max_rows: int, staleness: float, cache_rows: int,
                 data: Optional[Path] = None) -> None:
        hosted = client.model
        if "schema" not in hosted:
            raise ConfigError("the servers host a model that is not over a feature schema: nothing here serves it")
        self.client, self.staleness = client, staleness
        schema = measured(Schema.model_validate(hosted["schema"]), data)
        self.rows = row_format(schema, hosted, max_rows)
        self.model = SchemaModel(client, hosted_module(hosted))
        self.model_ref = hosted["model"]
        self._dims = {table_param(prefix, table): cfg.dim for prefix, bag in self.model.bags
                      for table, cfg in bag.configs.items()}
        self.cache = RowCache(cache_rows)
        self._weights: dict[str, torch.Tensor] = {}
        self._dense_at = -math.inf
        self._step: Optional[int] = None
        self._served = Served("online", None, None, 0.0)

    def answer(self, rows: list[Any]) -> tuple[list[float], Served]:
        batch = self.rows.batch(rows)
        lookups = {table_param(prefix, table): ids for prefix, bag in self.model.bags
                   for table, ids in bag.lookups(batch.sparse).items()}
        now = time.time()
        since = now - self.staleness
        found: dict[str, dict[int, tuple[float, torch.Tensor]]] = {}
        wanted: dict[str, torch.Tensor] = {}
        for param, ids in lookups.items():
            found[param], missing = self.cache.split(param, torch.unique(ids), since)
            if len(missing):
                wanted[param] = missing
        dense = self._dense_at < since
        if wanted or dense:
            self._read(wanted, dense, found)
        oldest = min([self._dense_at, *(at for entries in found.values() for at, _ in entries.values())])
        fetched = {param: torch.stack([found[param][i][1] for i in ids.tolist()]) if len(ids)
                   else self._empty(param) for param, ids in lookups.items()}
        with torch.no_grad():
            scores = torch.sigmoid(self.model.run((fetched, self._weights), batch)).tolist()
        self._served = Served("online", None, self._step, oldest)
        return scores, self._served

    def _read(self, wanted: dict[str, torch.Tensor], dense: bool,
              found: dict[str, dict[int, tuple[float, torch.Tensor]]]) -> None:
        at = time.time()            # the read reflects every update applied before it was sent
        try:
            try:
                rows, weights = self.client.fetch(wanted, dense=dense)
            except StaleLayout:        # rows moved to another server: read them where they are now
                self.client.follow_layout()
                rows, weights = self.client.fetch(wanted, dense=dense)
            step = self.client.call(self.client.leader, PsSurface.info).steps if dense else None
        except Exception as exc:  # noqa: BLE001 - whatever broke the read, the answer is the same refusal
            lost = getattr(exc, "servers", None) or self.client.losses.lost() or self.client.routes.servers
            raise PeerUnavailable(f"cannot read the model from {', '.join(lost)}: {str(exc).splitlines()[0]}") from None
        for param, ids in wanted.items():
            found[param].update(self.cache.put(param, ids, rows[param].float(), at))
        if dense:
            self._weights, self._dense_at, self._step = {n: w.float() for n, w in weights.items()}, at, step

    def _empty(self, param: str) -> torch.Tensor:
        return torch.zeros(0, self._dims[param])

    def served(self) -> Served:
        return self._served
