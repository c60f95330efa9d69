"""The rpcps_* metrics every role exports, on an injected registry, with role and name bound; a
role's own families extend ``Metrics`` beside the role (``ps/server/metrics.py``, ``trainer/*/metrics.py``).

Nothing is registered at import time: each process (and each test) builds its own registry.
"""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        self.registry = registry
        self.labels = {"role": role, "name": name}
        ProcessCollector(registry=registry)     # process_open_fds, process_max_fds, memory, CPU
        self.up = self.gauge("rpcps_up", "1 while the role is joined and serving or training")
        self.members = self.gauge("rpcps_members", "RPC group members this process currently sees")
        self.members_evicted = self.counter("rpcps_members_evicted_total",
                                            "members evicted after failed liveness probes").labels(**self.labels)
        self.restarts_in_a_row = self.gauge("rpcps_restarts_in_a_row",
                                            "deaths in a row before this process started (set by rpcps up)")
        self.episode_running = self.gauge("rpcps_episode_running",
                                          "1 while an episode (LM) or a batch of episodes (RL) runs")
        self.episodes = self.counter("rpcps_episodes_total", "episodes completed").labels(**self.labels)
        # services/progress.py: the work under way (an episode's steps, a batch of episodes, an evaluation)
        self.progress_done = self.gauge("rpcps_progress_done_ratio",
                                        "share of the work under way that is done (NaN: unbounded)")
        self.progress_eta = self.gauge("rpcps_progress_eta_seconds",
                                       "seconds until the work under way is done, at the recent rate (NaN: unknown)")
        # Set by the role that takes cluster checkpoints (ps0, the agent): what alerts watch.
        self.checkpoint_last_success = self.gauge("rpcps_checkpoint_last_success_timestamp_seconds",
                                                  "Unix time of the last checkpoint taken (0: none since start)")
        self.checkpoint_failures = self.counter(
            "rpcps_checkpoint_failures_total",
            "checkpoints that failed (409s for overlapping requests not counted)").labels(**self.labels)

    def counter(self, metric: str, doc: str, extra: Sequence[str] = ()) -> Counter:
        """A counter family labelled role, name and ``extra``."""
        return Counter(metric, doc, [*self.labels, *extra], registry=self.registry)

    def gauge(self, metric: str, doc: str) -> Gauge:
        """A gauge of this process (role and name bound)."""
        return Gauge(metric, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def histogram(self, metric: str, doc: str, extra: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        """A histogram family labelled role, name and ``extra``."""
        return Histogram(metric, doc, [*self.labels, *extra], buckets=buckets, registry=self.registry)
