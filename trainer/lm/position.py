"""A language-model trainer's position in its text: what checkpoints save of it, and where it
resumes from the positions a checkpoint saved.

The same trainer count on the same data resumes exactly: position, epoch, LSTM state. A different
count re-divides the data, so there is no exact position for a new share; each trainer starts its
share as far in as the saved trainers had come on average (their shares are equal-sized and they
run in near lockstep), with fresh LSTM state. No RPC here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ResumePoint:
    position: int
    epoch: int
    steps: int
    hidden: Optional[list] = None   # only for an exact resume
    exact: bool = True


def resume_point(saved: list[dict[str, Any]], name: str, num_trainers: int, data: str, rows: int
                 ) -> tuple[Optional[ResumePoint], str]:
    """(where to resume or None to start at the beginning, why) for trainer ``name`` of
    ``num_trainers`` whose share of ``data`` has ``rows`` rows."""
    if not saved:
        return None, "the checkpoint holds no trainer positions"
    same_data = [s for s in saved if s.get("data") == data]
    if not same_data:
        return None, f"the checkpoint's trainers read {saved[0].get('data')!r}, not {data!r}"
    mine = next((s for s in same_data if s.get("name") == name), None)
    if mine is not None and mine.get("num_trainers") == num_trainers and mine.get("rows", rows) == rows:
        return ResumePoint(int(mine["position"]), int(mine["epoch"]), int(mine["steps"]), mine.get("hidden")), \
            "same trainers, same data"
    sized = [s for s in same_data if s.get("rows")]
    if not sized:
        return None, "the checkpoint's positions do not say how long their shares were"
    # Progress through the data as epochs plus a fraction of a share, averaged over the saved trainers.
    progress = sum(s["epoch"] + min(s["position"] / s["rows"], 1.0) for s in sized) / len(sized)
    epoch = int(progress)
    position = min(int((progress - epoch) * rows), max(rows - 2, 0))
    # The cluster's steps, spread evenly: `rpcps up` sums trainers' steps into its total.
    steps = sum(int(s.get("steps", 0)) for s in same_data) // max(1, num_trainers)
    return ResumePoint(position, epoch, steps, None, exact=False), \
        f"{len(same_data)} trainers saved, {num_trainers} now: re-divided at {progress - epoch:.0%} of epoch {epoch}"


def position_of(loop: Any, name: str, num_trainers: int, data: str, steps: int) -> dict[str, Any]:
    """What a checkpoint saves of a trainer (``loop`` a ``TrainLoop``, held at a step boundary)."""
    return {"name": name, "num_trainers": num_trainers, "data": data, "position": loop.stream.position,
            "epoch": loop.stream.epoch, "rows": loop.stream.data.size(0),
            "hidden": [loop.hidden[0].clone(), loop.hidden[1].clone()], "steps": steps}


def move_to(loop: Any, point: ResumePoint) -> None:
    """Put ``loop`` where ``point`` says (its LSTM state only when it has that state's shape)."""
    loop.stream.position, loop.stream.epoch = point.position, point.epoch
    if point.hidden is not None and tuple(point.hidden[0].shape) == tuple(loop.hidden[0].shape):
        loop.hidden = (point.hidden[0], point.hidden[1])
