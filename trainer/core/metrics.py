"""The metrics of a trainer of a server-hosted workload, besides every role's
(``services/metrics.py``); its workload names the unit its throughput counts and adds its own."""
from __future__ import annotations

from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from services.metrics import Metrics

STEP_PHASES = ("fetch", "forward", "backward", "clip", "optimize", "barrier", "total")
# The stepping thread's CPU by phase: making the batch (with the wait at the step clock), reading
# the rows, the forward pass, the backward pass (with the replica's all-reduce), and the update
# (handing over or applying, the clock). What other threads spend (RPC, all-reduce loops) is not in it.
CPU_PHASES = ("batch", "fetch", "forward", "backward", "update", "total")


class TrainerMetrics(Metrics):
    unit: ClassVar[str] = "tokens"       # rpcps_trainer_<unit>_total, rpcps_trainer_<unit>_per_second

    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        super().__init__(registry, role, name)
        unit = self.unit
        self.steps = self.counter("rpcps_trainer_steps_total", "training steps completed").labels(**self.labels)
        self.units = self.counter(f"rpcps_trainer_{unit}_total", f"{unit} trained on").labels(**self.labels)
        self.steps_refused = self.counter("rpcps_trainer_steps_refused_total", "steps whose update the servers "
                                          "refused (gradients not finite), skipped").labels(**self.labels)
        self.server_losses = self.counter("rpcps_trainer_server_losses_total", "times a parameter server went "
                                          "away under a step (the step lost, the trainer waiting for "
                                          "it)").labels(**self.labels)
        self.waiting_for_servers = self.gauge("rpcps_trainer_waiting_for_servers", "parameter servers this trainer "
                                              "waits to come back (0: none)")
        self.loss = self.gauge("rpcps_trainer_loss", "training loss of the last step")
        self.per_second = self.gauge(f"rpcps_trainer_{unit}_per_second", "training throughput of the current episode")
        self._step_seconds = self.histogram("rpcps_trainer_step_seconds", "time of a training step by phase", ("phase",))
        for phase in STEP_PHASES:   # every phase series at 0, so dashboards see them before the first step
            self._step_seconds.labels(phase=phase, **self.labels)
        self._step_cpu = self.counter("rpcps_trainer_step_cpu_seconds_total", "CPU seconds the training thread "
                                      "spent in its steps, by phase (batch, fetch, forward, backward, update, "
                                      "total)", ("phase",))
        for phase in CPU_PHASES:
            self._step_cpu.labels(phase=phase, **self.labels)
        self._cache_ids = self.counter("rpcps_trainer_cache_ids_total", "--cache-rows: a step's distinct ids taken "
                                       "from the trainer's copies (hit) or read from the servers (miss)", ("outcome",))
        self._cache_lookups = self.counter("rpcps_trainer_cache_lookups_total", "--cache-rows: the ids a step's "
                                           "batch named, each as often as named, taken from the trainer's copies "
                                           "(hit) or read from the servers (miss)", ("outcome",))
        self.cache_bytes_saved = self.counter("rpcps_trainer_cache_bytes_saved_total", "--cache-rows: bytes of rows "
                                              "taken from the trainer's copies instead of read").labels(**self.labels)
        self.cache_rows = self.gauge("rpcps_trainer_cache_rows", "--cache-rows: copies of rows the trainer holds")
        self.cache_oldest = self.gauge("rpcps_trainer_cache_oldest_steps", "--cache-rows: the oldest copy a step "
                                                                           "took so far, in the trainer's steps")

    def observe_phase(self, phase: str, seconds: float) -> None:
        self._step_seconds.labels(phase=phase, **self.labels).observe(seconds)

    def stepped(self, result: Any) -> None:
        """A step done (a ``trainer.core.loop.StepResult``)."""
        for phase, seconds in result.phases.items():
            self.observe_phase(phase, seconds)
        for phase, seconds in result.cpu.items():
            self._step_cpu.labels(phase=phase, **self.labels).inc(max(0.0, seconds))
        if result.cache is not None:
            self._cache_ids.labels(outcome="hit", **self.labels).inc(result.cache.hits)
            self._cache_ids.labels(outcome="miss", **self.labels).inc(result.cache.misses)
            self._cache_lookups.labels(outcome="hit", **self.labels).inc(result.cache.hit_lookups)
            self._cache_lookups.labels(outcome="miss", **self.labels).inc(result.cache.lookups - result.cache.hit_lookups)
            self.cache_bytes_saved.inc(result.cache.saved)
            self.cache_rows.set(result.cache.rows)
            self.cache_oldest.set(result.cache.max_age)
        self.steps.inc()
        self.units.inc(result.units)
        self.loss.set(result.loss)
