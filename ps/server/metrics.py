"""A parameter server's metrics, besides every role's (``services/metrics.py``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from services.metrics import LATENCY_BUCKETS, Metrics

WAIT_BUCKETS = LATENCY_BUCKETS + (30.0, 60.0)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


class PsMetrics(Metrics):
    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        super().__init__(registry, role, name)
        self._requests = self.counter("rpcps_ps_requests_total", "RPC requests served, by method", ("method",))
        self._request_errors = self.counter("rpcps_ps_request_errors_total", "RPC requests answered with an error",
                                            ("method",))
        self._request_seconds = self.histogram("rpcps_ps_request_seconds", "server time of an RPC request, by method",
                                               ("method",))
        self.rows_looked_up = self.counter("rpcps_ps_rows_looked_up_total",
                                           "table rows returned by lookups").labels(**self.labels)
        self.rows_updated = self.counter("rpcps_ps_rows_updated_total",
                                         "table rows changed by optimizer steps").labels(**self.labels)
        self.optimizer_steps = self.counter("rpcps_ps_optimizer_steps_total",
                                            "optimizer steps applied").labels(**self.labels)
        self.updates_refused = self.counter(
            "rpcps_ps_updates_refused_total", "trainers' updates refused whole: gradients not finite"
        ).labels(**self.labels)
        self.requests_superseded = self.counter(
            "rpcps_ps_requests_superseded_total", "requests of a member's old incarnation (evicted, or replaced by "
            "a newer start) refused whole"
        ).labels(**self.labels)
        self.requests_stale = self.counter(
            "rpcps_ps_requests_stale_layout_total", "requests planned with another layout epoch that named a part "
            "this server does not hold at its own, refused whole"
        ).labels(**self.labels)
        self.layout_epoch = self.gauge("rpcps_ps_layout_epoch", "the layout epoch this server serves by")
        # The leader's: its changes of layout while training goes on.
        self.layout_changes = self.counter("rpcps_ps_layout_changes_total", "changes of layout the leader made "
                                           "while training went on, by how they ended", ("result",))
        for result in ("done", "failed"):       # at 0 from the start: a rate over the first change is right
            self.layout_changes.labels(**self.labels, result=result)
        self.layout_change_pause = self.gauge("rpcps_ps_layout_change_pause_seconds",
                                              "seconds the last change of layout held the trainers")
        self.layout_change_seconds = self.gauge("rpcps_ps_layout_change_seconds", "seconds the last change of "
                                                "layout took, from its start to its end, the copying ahead included")
        self.layout_change_bytes = self.gauge("rpcps_ps_layout_change_bytes",
                                              "bytes of rows and their state the last change of layout moved")
        self.slots_owned = self.gauge("rpcps_ps_slots", "the layout's slots this server owns")
        # The step clock's, on the leader (sync and ssp modes); staleness is every server's.
        self.barrier_wait = self.histogram(
            "rpcps_ps_barrier_wait_seconds", "time a trainer waited at the step clock (sync: for the step to be "
            "applied; ssp: for the slowest to catch up; hybrid: for every trainer to begin the step)",
            buckets=WAIT_BUCKETS).labels(**self.labels)
        # Hashed tables (``ps/server/hashed/``), by table.
        self._hashed_rows = Gauge("rpcps_ps_hashed_rows", "a hashed table's rows in use", [*self.labels, "table"],
                                  registry=registry)
        self._hashed_capacity = Gauge("rpcps_ps_hashed_capacity", "a hashed table's rows on this server",
                                      [*self.labels, "table"], registry=registry)
        self._hashed_totals = {k: self.counter(f"rpcps_ps_hashed_{k}_total", doc, ("table",)) for k, doc in (
            ("admitted", "ids a hashed table gave a row"), ("evicted", "ids that lost their row"),
            ("dropped", "lookups of ids without a row: zeros read, gradient dropped"))}
        self.stale_gradient_rows = self.counter(
            "rpcps_ps_hashed_stale_gradient_rows_total", "gradient rows dropped: their ids lost the row between "
            "the read and the update").labels(**self.labels)
        self._hashed_last: dict[tuple[str, str], int] = {}     # the totals last seen, for the counters' increase
        self.staleness = self.histogram(
            "rpcps_ps_update_staleness_steps", "updates this server applied between a trainer's first read of a "
            "step and that step's update (sync: 0)", buckets=STALENESS_BUCKETS).labels(**self.labels)
        self.short_steps = self.counter(
            "rpcps_ps_short_steps_total", "sync steps applied with fewer trainers than began them (one died or "
            "left)").labels(**self.labels)

    def hashed(self, tables: dict[str, dict], stale_rows: int) -> None:
        """Each hashed table's rows and what happened to them since the last call (the role's
        loop, once a second): totals become counters by their increase."""
        for table, t in tables.items():
            self._hashed_rows.labels(table=table, **self.labels).set(t["rows"])
            self._hashed_capacity.labels(table=table, **self.labels).set(t["capacity"])
            for k, counter in self._hashed_totals.items():
                counter.labels(table=table, **self.labels).inc(t[k] - self._hashed_last.get((table, k), 0))
                self._hashed_last[(table, k)] = t[k]
        self.stale_gradient_rows.inc(stale_rows - self._hashed_last.get(("", "stale"), 0))
        self._hashed_last[("", "stale")] = stale_rows

    # The step clock's metrics (``ps/leader/clock/``'s ``ClockMetrics``).
    def observe_wait(self, seconds: float) -> None:
        self.barrier_wait.observe(seconds)

    def short_step(self) -> None:
        self.short_steps.inc()

    def init_ps(self, methods: list[str]) -> None:
        """Create the request series of every remote method (and operation) at 0."""
        for method in methods:
            self._requests.labels(method=method, **self.labels)
            self._request_errors.labels(method=method, **self.labels)
            self._request_seconds.labels(method=method, **self.labels)

    def observe_request(self, method: str, seconds: float, ok: bool) -> None:
        self._requests.labels(method=method, **self.labels).inc()
        self._request_seconds.labels(method=method, **self.labels).observe(seconds)
        if not ok:
            self._request_errors.labels(method=method, **self.labels).inc()
