"""A language-model trainer's metrics, besides every role's (``services/metrics.py``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.metrics import Metrics

STEP_PHASES = ("fetch", "forward", "backward", "clip", "optimize", "barrier", "total")


class TrainerMetrics(Metrics):
    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        super().__init__(registry, role, name)
        self.steps = self.counter("rpcps_trainer_steps_total", "training steps completed").labels(**self.labels)
        self.tokens = self.counter("rpcps_trainer_tokens_total", "tokens trained on").labels(**self.labels)
        self.steps_refused = self.counter("rpcps_trainer_steps_refused_total", "steps whose update the servers "
                                          "refused (gradients not finite), skipped").labels(**self.labels)
        self.loss = self.gauge("rpcps_trainer_loss", "training loss of the last step")
        self.tokens_per_second = self.gauge("rpcps_trainer_tokens_per_second",
                                            "training throughput of the current episode")
        self.eval_loss = self.gauge("rpcps_trainer_eval_loss",
                                    "held-out loss of this trainer's share at the last episode end")
        self._step_seconds = self.histogram("rpcps_trainer_step_seconds", "time of a training step by phase", ("phase",))
        for phase in STEP_PHASES:   # every phase series at 0, so dashboards see them before the first step
            self._step_seconds.labels(phase=phase, **self.labels)

    def observe_phase(self, phase: str, seconds: float) -> None:
        self._step_seconds.labels(phase=phase, **self.labels).observe(seconds)
