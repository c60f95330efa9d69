"""What a counting server (``--count-updates``, ``ps/spec/counting.py``) says of the updates in its
rows: per table read by id, per slot, the sum of its rows' counts, for ``GET /counts``."""
from __future__ import annotations

from typing import Any

from ps.spec.counting import COUNT_KEY, counted_tables, slot_sums
from services.errors import NotSupported


def applied_counts(server: Any) -> dict[str, Any]:
    """The updates in ``server``'s rows by slot, read at one instant (under its optimizer's lock):
    ``applied`` per table, a list over the layout's slots (zeros where another server owns the
    slot)."""
    tables = counted_tables(server.spec)
    if not tables:
        raise NotSupported(f"{server.name} does not count updates: start every server with --count-updates")
    layout, shard = server.layout, server.shard
    count = layout.slots.count
    with server.optimizer.lock:
        applied = {}
        for table in tables:
            ids = layout.plans[table].global_ids(shard)
            param = server.params[layout.table_params[table][0]]
            rows = server.optimizer.live_state(param).get(COUNT_KEY)
            applied[table] = slot_sums(ids, rows, count) if rows is not None and ids.numel() else [0] * count
        return {"server": server.name, "epoch": layout.epoch, "slots": count, "steps": server.optimizer.steps,
                "applied": applied}
