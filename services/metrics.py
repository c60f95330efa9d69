"""Every rpcps_* metric, defined once, on an injected registry, with role and name bound.

Nothing is registered at import time: each process (and each test) builds its own registry.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_PHASES = ("fetch", "forward", "backward", "clip", "optimize", "total")


class Metrics:
    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        self.registry = registry
        self.labels = {"role": role, "name": name}
        base = ["role", "name"]

        def counter(metric: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(metric, doc, base + list(extra), registry=registry)

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(metric, doc, base, registry=registry).labels(**self.labels)

        self.up = gauge("rpcps_up", "1 while the role is joined and serving or training")
        self.members = gauge("rpcps_members", "RPC group members this process currently sees")
        self.members_evicted = counter("rpcps_members_evicted_total", "members evicted after failed liveness probes").labels(**self.labels)
        self.episode_running = gauge("rpcps_episode_running", "1 while an episode (LM) or a batch of episodes (RL) runs")
        # Set by the role that takes cluster checkpoints (ps0, the agent): what alerts watch.
        self.checkpoint_last_success = gauge("rpcps_checkpoint_last_success_timestamp_seconds",
                                             "Unix time of the last checkpoint taken (0: none since start)")
        self.checkpoint_failures = counter("rpcps_checkpoint_failures_total",
                                           "checkpoints that failed (409s for overlapping requests not counted)").labels(**self.labels)

        # trainer
        self.steps = counter("rpcps_trainer_steps_total", "training steps completed").labels(**self.labels)
        self.tokens = counter("rpcps_trainer_tokens_total", "tokens trained on").labels(**self.labels)
        self.loss = gauge("rpcps_trainer_loss", "training loss of the last step")
        self.tokens_per_second = gauge("rpcps_trainer_tokens_per_second", "training throughput of the current episode")
        self.eval_loss = gauge("rpcps_trainer_eval_loss", "held-out loss of this trainer's share at the last episode end")
        self.episodes = counter("rpcps_episodes_total", "episodes completed").labels(**self.labels)
        self._step_seconds = Histogram("rpcps_trainer_step_seconds", "time of a training step by phase",
                                       base + ["phase"], buckets=_LATENCY_BUCKETS, registry=registry)

        # parameter server
        self._requests = counter("rpcps_ps_requests_total", "RPC requests served, by method", ("method",))
        self._request_errors = counter("rpcps_ps_request_errors_total", "RPC requests answered with an error", ("method",))
        self._request_seconds = Histogram("rpcps_ps_request_seconds", "server time of an RPC request, by method",
                                          base + ["method"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.rows_looked_up = counter("rpcps_ps_rows_looked_up_total", "embedding rows returned by lookups").labels(**self.labels)
        self.rows_updated = counter("rpcps_ps_rows_updated_total", "embedding rows changed by optimizer steps").labels(**self.labels)
        self.optimizer_steps = counter("rpcps_ps_optimizer_steps_total", "optimizer steps applied").labels(**self.labels)

        # RL agent and observers
        self.env_steps = counter("rpcps_rl_env_steps_total",
                                 "environment steps taken (observer) or learned from (agent)").labels(**self.labels)
        self.rl_reward = gauge("rpcps_rl_reward", "mean total reward of the observers in the last episode")
        self.rl_running_reward = gauge("rpcps_rl_running_reward", "running reward: 0.05 x last episode + 0.95 x before")
        self.rl_steps_per_second = gauge("rpcps_rl_env_steps_per_second", "environment steps per second in the last episode")
        self.rl_observers_lost = counter("rpcps_rl_observers_lost_total",
                                         "observers lost in the middle of an episode").labels(**self.labels)
        self._rl_batch = Histogram("rpcps_rl_action_batch_size", "observers answered by one forward pass", base,
                                   buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=registry)

    def init_rl(self) -> None:
        self._rl_batch.labels(**self.labels)

    def observe_batch(self, size: int) -> None:
        self._rl_batch.labels(**self.labels).observe(size)

    def init_trainer(self) -> None:
        """Create every phase series at 0 so dashboards see them before the first step."""
        for phase in STEP_PHASES:
            self._step_seconds.labels(phase=phase, **self.labels)

    def init_ps(self, methods: list[str]) -> None:
        """Create the request series of every remote method at 0."""
        for method in methods:
            self._requests.labels(method=method, **self.labels)
            self._request_errors.labels(method=method, **self.labels)
            self._request_seconds.labels(method=method, **self.labels)

    def observe_phase(self, phase: str, seconds: float) -> None:
        self._step_seconds.labels(phase=phase, **self.labels).observe(seconds)

    def observe_request(self, method: str, seconds: float, ok: bool) -> None:
        self._requests.labels(method=method, **self.labels).inc()
        self._request_seconds.labels(method=method, **self.labels).observe(seconds)
        if not ok:
            self._request_errors.labels(method=method, **self.labels).inc()
