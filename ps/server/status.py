"""A parameter server's /status."""
from __future__ import annotations

from typing import Any, Optional

from services.lifecycle import RoleStatus


class PsStatus(RoleStatus):
    shard: Optional[int] = None
    num_shards: Optional[int] = None
    rows: Optional[int] = None                     # rows of every table this shard owns
    tables: Optional[dict[str, int]] = None        # the same, per table
    dense: Optional[list[str]] = None              # the dense tensors it holds
    model: Optional[dict[str, Any]] = None
    steps: int = 0                                 # updates applied
    refused: int = 0                               # updates refused whole (gradients not finite)
    superseded: int = 0                            # requests of old incarnations refused (fenced members)
    applied: Optional[dict[str, Any]] = None       # per trainer: steps and records applied here; repeats not applied
    consistency: Optional[str] = None              # async, sync, hybrid or ssp:K
    clock: Optional[dict[str, Any]] = None         # ps0 in sync/ssp: trainers' step clocks, whom a barrier waits for
    work: Optional[dict[str, dict[str, float]]] = None  # lookup, update: rows, seconds, rows_per_s
    hashed: Optional[dict[str, dict[str, Any]]] = None  # per hashed table: rows, capacity, admitted, evicted, …

    def line(self) -> list[str]:
        out = [f"shard {self.shard}/{self.num_shards}", f"{self.rows} rows", f"members {len(self.members or [])}",
               f"consistency {self.consistency}"]
        if self.refused:
            out.append(f"{self.refused} updates refused")
        if self.superseded:
            out.append(f"{self.superseded} requests of old incarnations refused")
        if (self.applied or {}).get("repeated"):
            out.append(f"{self.applied['repeated']} repeated batches not applied again")
        if self.hashed:
            rows = sum(t["rows"] for t in self.hashed.values())
            capacity = sum(t["capacity"] for t in self.hashed.values())
            out.append(f"hashed {rows}/{capacity} rows, {sum(t['evicted'] for t in self.hashed.values())} evicted")
        waiting = (self.clock or {}).get("waiting")
        if waiting:
            out.append(f"step {waiting['step']} waiting {waiting['seconds']:.1f}s for {', '.join(waiting['on'])}")
        return out
