"""The RL agent's and observers' metrics, besides every role's (``services/metrics.py``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.metrics import Metrics


class RlMetrics(Metrics):
    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        super().__init__(registry, role, name)
        self.env_steps = self.counter("rpcps_rl_env_steps_total",
                                      "environment steps taken (observer) or learned from (agent)").labels(**self.labels)
        self.rl_reward = self.gauge("rpcps_rl_reward", "mean total reward of the observers in the last episode")
        self.rl_running_reward = self.gauge("rpcps_rl_running_reward",
                                            "running reward: 0.05 x last episode + 0.95 x before")
        self.rl_steps_per_second = self.gauge("rpcps_rl_env_steps_per_second",
                                              "environment steps per second in the last episode")
        self.rl_observers_lost = self.counter("rpcps_rl_observers_lost_total",
                                              "observers lost in the middle of an episode").labels(**self.labels)
        self._rl_batch = self.histogram("rpcps_rl_action_batch_size", "observers answered by one forward pass",
                                        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        self._rl_batch.labels(**self.labels)

    def observe_batch(self, size: int) -> None:
        self._rl_batch.labels(**self.labels).observe(size)
