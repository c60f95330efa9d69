"""What a counting server (``--count-updates``, ``ps/spec/counting.py``) says of the updates in its
rows: per table read by id, per slot, the sum of its rows' counts, for ``GET /counts``."""
from __future__ import annotations

from typing import Any

from ps.spec.counting import COUNT_KEY, counted_tables, slot_sums
from ps.spec.sharding import NO_ID
from services.errors import NotSupported


def applied_counts(server: Any) -> dict[str, Any]:
    """The updates in ``server``'s rows by slot, read at one instant (under its optimizer's lock):
    ``applied`` per table, a list over the layout's slots (zeros where another server owns the
    slot)."""
    tables = counted_tables(server.spec)
    if not tables:
        raise NotSupported(f"{server.name} does not count updates: start every server with --count-updates")
    # Inside the gate, as a request is: a change of layout does not rebuild the shard meanwhile.
    # Copied under the optimizer's lock, summed after it: a sum over every row would hold updates.
    server.gate.enter()
    try:
        with server.optimizer.lock:
            layout, shard, steps = server.layout, server.shard, server.optimizer.steps
            copied = {}
            for table in tables:
                rows = server.optimizer.live_state(server.params[layout.table_params[table][0]]).get(COUNT_KEY)
                copied[table] = rows.clone() if rows is not None else None
    finally:
        server.gate.leave()
    count = layout.slots.count
    applied = {}
    for table, rows in copied.items():
        ids = layout.plans[table].global_ids(shard)
        held = ids != NO_ID         # an empty column's rows count nothing
        applied[table] = slot_sums(ids[held], rows[held], count) if rows is not None and ids.numel() else [0] * count
    return {"server": server.name, "epoch": layout.epoch, "slots": count, "steps": steps, "applied": applied}
