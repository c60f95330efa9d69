"""A CTR trainer's metrics, besides every trainer's (``trainer/core/metrics.py``)."""
from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry

from trainer.core.metrics import TrainerMetrics


class CtrMetrics(TrainerMetrics):
    unit = "samples"

    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        super().__init__(registry, role, name)
        self.eval_auc = self.gauge("rpcps_trainer_eval_auc", "held-out ROC AUC at the last episode end")
        self.eval_logloss = self.gauge("rpcps_trainer_eval_logloss", "held-out logloss at the last episode end")
        self.oracle_auc = self.gauge("rpcps_trainer_oracle_auc", "generated data: the ground truth's AUC on the same "
                                                                 "held-out samples, the best any model can reach")
        self.lines_skipped = self.counter("rpcps_trainer_lines_skipped_total",
                                          "malformed data lines skipped in training").labels(**self.labels)
        self.lists_truncated = self.counter("rpcps_trainer_lists_truncated_total",
                                            "a schema's lists longer than their max_length, cut in training"
                                            ).labels(**self.labels)
        self.behind_records = self.gauge("rpcps_trainer_behind_records", "--follow: records landed in the folder "
                                                                         "that this trainer has not reached yet, "
                                                                         "every trainer's share")
        self.behind_seconds = self.gauge("rpcps_trainer_behind_seconds", "--follow: seconds since the oldest file "
                                                                         "not read through landed (0: caught up)")
        for gauge in (self.eval_auc, self.eval_logloss, self.oracle_auc):
            gauge.set(math.nan)       # none yet

    def held_out(self, found: dict[str, Any]) -> None:
        self.eval_auc.set(found["auc"])
        self.eval_logloss.set(found["logloss"])
        if found.get("oracle_auc") is not None:
            self.oracle_auc.set(found["oracle_auc"])

    def behind(self, records: int, seconds: float) -> None:
        self.behind_records.set(records)
        self.behind_seconds.set(seconds)
