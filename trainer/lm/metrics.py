"""A language-model trainer's metrics, besides every trainer's (``trainer/core/metrics.py``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from trainer.core.metrics import TrainerMetrics as _Trainer


class TrainerMetrics(_Trainer):
    unit = "tokens"

    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        super().__init__(registry, role, name)
        self.eval_loss = self.gauge("rpcps_trainer_eval_loss",
                                    "held-out loss of this trainer's share at the last episode end")
