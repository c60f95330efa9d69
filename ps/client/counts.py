"""A trainer's side of counted updates (``ps/spec/counting.py``): per table the servers count, per
slot, the rows of the slot that the steps whose update every server acknowledged read (``acked``:
a step that read three ids of a slot counts three), and those of the steps that failed after their
update was sent, which a server may have applied (``unsure``)."""
from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

import torch


class UpdateCounts:
    def __init__(self, tables: Iterable[str], table_of: Mapping[str, str], slots: int) -> None:
        """``tables``: those the servers count; ``table_of``: each table parameter's table."""
        self.tables, self._table_of, self.slots = tuple(tables), dict(table_of), slots
        self._lock = threading.Lock()       # a step records on the training thread; ``GET /counts`` reads
        self._acked = {t: torch.zeros(slots, dtype=torch.int64) for t in self.tables}
        self._unsure = {t: torch.zeros(slots, dtype=torch.int64) for t in self.tables}
        self.steps = {"acked": 0, "unsure": 0}

    def record(self, lookups: Iterable[Mapping[str, torch.Tensor]], acked: bool) -> None:
        """One step's end: ``lookups``, every read (or push) of the step, parameter -> ids; a row
        counts once a step however many times, in however many reads, the step named it (a
        server applies the step's summed gradient to it once)."""
        ids: dict[str, list[torch.Tensor]] = {}
        for asked in lookups:
            for param, given in asked.items():
                table = self._table_of.get(param)
                if table in self._acked:
                    ids.setdefault(table, []).append(given.reshape(-1))
        into = self._acked if acked else self._unsure
        with self._lock:
            self.steps["acked" if acked else "unsure"] += 1
            for table, parts in ids.items():
                into[table] += torch.bincount(torch.cat(parts).unique() % self.slots, minlength=self.slots)

    def snapshot(self) -> dict[str, Any]:
        """``GET /counts``: per table, a list over the slots."""
        with self._lock:
            return {"slots": self.slots, "steps": dict(self.steps),
                    "acked": {t: v.tolist() for t, v in self._acked.items()},
                    "unsure": {t: v.tolist() for t, v in self._unsure.items()}}
