"""A CTR trainer's /status: what `rpcps status` and `rpcps up` read of it, besides every
trainer's (``trainer/core/status.py``)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel

from trainer.core.status import TrainerStatusBase


class CtrHeldOut(BaseModel):
    samples: int
    positives: int
    auc: float
    logloss: float
    oracle_auc: Optional[float] = None   # generated data: the ground truth's AUC on the same samples


class TimedWindow(BaseModel):
    """An episode's timed samples and wall-clock window (warm-up steps left out)."""

    samples: int = 0
    start: Optional[float] = None
    end: Optional[float] = None


class CtrStatus(TrainerStatusBase):
    samples_per_s: Optional[float] = None
    timed: Optional[TimedWindow] = None
    eval: Optional[CtrHeldOut] = None      # on the held-out samples, which every trainer evaluates alike
    skipped_lines: int = 0                 # malformed data lines skipped in training
    last_skipped: Optional[str] = None     # the last one, and why
    truncated_lists: int = 0               # a schema's lists longer than their max_length, cut in training
    behind_records: Optional[int] = None   # --follow: records landed not reached yet (every trainer's share)
    behind_seconds: Optional[float] = None  # --follow: since the oldest file not read through landed (0: caught up)
    data_position: Optional[dict] = None   # --follow: the file being read (or read last) and its records passed

    def line(self) -> list[str]:
        e = self.eval
        quality = [] if e is None else [f"AUC {e.auc:.4f}" + ("" if e.oracle_auc is None else f" (best {e.oracle_auc:.4f})"),
                                        f"logloss {e.logloss:.4f}"]
        return self.steps_line() + [f"{self.samples_per_s or 0:.0f} samples/s", f"consistency {self.consistency or '-'}"] \
            + quality + self.eta() + self.failures_line() \
            + ([f"{self.skipped_lines} lines skipped"] if self.skipped_lines else []) \
            + ([f"{self.behind_records} records behind ({self.behind_seconds or 0:.1f}s)"]
               if self.behind_records is not None else [])
