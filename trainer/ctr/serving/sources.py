"""Where a serving member's model comes from, and what it says of what it serves."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from rpcps.saved import load_model
from rpcps.schema import Schema
from services.errors import ConfigError
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
        """The ``X-Rpcps-Served`` header: ``snapshot step-40``."""
        return " ".join(str(part) for part in (self.source, self.checkpoint or self.step) if part is not None)


class Source(Protocol):
    rows: RowFormat
    model_ref: str

    def answer(self, rows: list[Any]) -> tuple[list[float], Served]: ...
    def served(self) -> Served: ...


def row_format(schema: Schema, described: dict[str, Any], max_rows: int) -> RowFormat:
    """How a request's rows become the model's batches: as its trainers read their files (the
    built-in DLRM's, Criteo's format; any other model's, its schema's)."""
    criteo = described.get("criteo")
    if criteo is None:
        return SchemaRows(schema, max_rows)
    hashed = set(criteo["hashed"])
    return CriteoRows([0 if t in hashed else rows for t, rows in enumerate(criteo["cardinalities"])], max_rows)


class Snapshot:
    """An exported model (``rpcps export``), all in memory: the rows a request names are read from
    its tables as the servers' evaluation read them, and never change."""

    def __init__(self, folder: Path, max_rows: int) -> None:
        if not folder.is_dir():
            raise ConfigError(f"--snapshot {folder}: no such folder (rpcps export --out writes one)")
        try:
            self.model = load_model(folder)
            exported = self.model.exported
            self.rows = row_format(self.model.schema, exported, max_rows)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"--snapshot {folder}: {exc}") from None
        self.model_ref = exported["model"]
        self._served = Served("snapshot", exported["checkpoint"], exported["step"],
                              float(exported.get("taken_at", exported["exported_at"])))

    def answer(self, rows: list[Any]) -> tuple[list[float], Served]:
        batch = self.rows.batch(rows)
        with torch.no_grad():
            return torch.sigmoid(self.model(batch)).tolist(), self._served

    def served(self) -> Served:
        return self._served
