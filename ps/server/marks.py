"""Which of each trainer's batches a server has applied (``AppliedMarks``), kept with its shard.

Every update a trainer sends carries its ``Mark`` (``ps/spec/messages.py``): the trainer's steps
once it is applied, the records of its batch and where its data stands after it. A server applies
a trainer's update only if its steps are past the newest it applied of that trainer, and keeps that
mark with the parameters it changed: in its checkpoints, and across a restore. A trainer started
again after dying mid-step asks every server for its newest mark, resumes after the oldest of them
(a server its last update did not reach has not trained that batch), and numbers its batches as its
predecessor did: a server that applied a batch already answers the repeat without applying it.
So each server trains each record once, whatever dies when; its ``records`` per trainer say so.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

from ps.spec.messages import Mark


class AppliedMarks:
    """Per trainer, the newest mark applied here and the records applied in all; ``repeated``:
    updates answered without applying them, their batch applied here before."""

    def __init__(self, saved: Optional[Mapping[str, dict]] = None) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, dict[str, Any]] = {t: dict(m) for t, m in (saved or {}).items()}
        self.repeated = 0

    def fresh(self, trainer: str, mark: Mark) -> bool:
        with self._lock:
            known = self._marks.get(trainer)
            return known is None or mark.steps > int(known["steps"])

    def record(self, marks: Mapping[str, Mark]) -> None:
        with self._lock:
            for trainer, mark in marks.items():
                records = int(self._marks.get(trainer, {}).get("records", 0)) + mark.records
                self._marks[trainer] = {"steps": mark.steps, "records": records, "position": dict(mark.position)}

    def repeat(self) -> None:
        with self._lock:
            self.repeated += 1

    def of(self, trainer: str) -> Optional[dict[str, Any]]:
        with self._lock:
            known = self._marks.get(trainer)
            return None if known is None else dict(known)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {t: dict(m) for t, m in self._marks.items()}

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows: each trainer's steps and records applied here, and the repeats."""
        with self._lock:
            return {"trainers": {t: {"steps": m["steps"], "records": m["records"]} for t, m in self._marks.items()},
                    "repeated": self.repeated}


def gather_marks(states: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The marks of a shard restored from ``states`` (every old shard, or its own): per trainer the
    oldest, so that a trainer resuming there trains again what some old shard had not applied."""
    out: dict[str, dict[str, Any]] = {}
    for state in states:
        for trainer, mark in state.get("marks", {}).items():
            if trainer not in out or int(mark["steps"]) < int(out[trainer]["steps"]):
                out[trainer] = dict(mark)
    return out
