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
    stale: int = 0                                 # requests planned with another layout, refused
    # the layout this server serves by: its epoch, its slot count, slots and units per server
    layout: Optional[dict[str, Any]] = None
    # the leader: its last change of layout (epoch, from, to, state, slots moved, bytes, the trainers'
    # hold, where it went) or the one under way (state moving, elapsed_seconds)
    change: Optional[dict[str, Any]] = None
    wanted: Optional[list[str]] = None             # the leader: the servers a change asked for waits on to serve
    applied: Optional[dict[str, Any]] = None       # per trainer: steps and records applied here; repeats not applied
    consistency: Optional[str] = None              # async, sync, hybrid or ssp:K
    clock: Optional[dict[str, Any]] = None         # ps0 in sync/ssp: trainers' step clocks, whom a barrier waits for
    work: Optional[dict[str, dict[str, float]]] = None  # lookup, update: rows, seconds, rows_per_s
    hashed: Optional[dict[str, dict[str, Any]]] = None  # per hashed table: rows, capacity, admitted, evicted, …

    def line(self) -> list[str]:
        out = [f"shard {self.shard}/{self.num_shards}", f"{self.rows} rows", f"members {len(self.members or [])}",
               f"consistency {self.consistency}"]
        if self.layout:
            mine = self.layout["servers"].get(self.name, {}).get("slots", 0)
            out.append(f"layout {self.layout['epoch']}, {mine}/{self.layout['slots']} slots")
        if self.stale:
            out.append(f"{self.stale} requests of another layout refused")
        if self.wanted:
            out.append(f"a change onto {', '.join(self.wanted)} waits for them to serve")
        if self.change and self.change.get("state") == "moving":
            out.append(f"layout {self.change['epoch']} moving: {self.change['moved_slots']} slots, "
                       f"{self.change.get('elapsed_seconds', 0):g}s so far")
        elif self.change and self.change.get("state") in ("done", "failed"):
            out.append(f"last change: layout {self.change['epoch']} {self.change['state']}"
                       + (f", trainers held {self.change['pause_seconds']:g}s" if self.change["state"] == "done" else ""))
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


def shard_status(layout: Any, shard: int, metrics: Any) -> dict[str, Any]:
    """What a server's /status says of its shard under ``layout`` (a ``Layout``), its metrics set
    to match: the layout, and the rows and dense tensors it holds."""
    slots = layout.slots
    rows = {t: p.held(shard) for t, p in layout.plans.items()}
    metrics.layout_epoch.set(slots.epoch)
    metrics.slots_owned.set(int(slots.owned[shard]) if shard < slots.num_shards else 0)     # past the end: none
    return {"layout": slots.describe(), "shard": shard, "num_shards": slots.num_shards, "rows": sum(rows.values()),
            "tables": rows, "dense": layout.dense_of(shard)}
