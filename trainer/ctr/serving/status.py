"""A serving member's /status and metrics, besides every role's."""
from __future__ import annotations

import math
from typing import Any, Optional

from prometheus_client import CollectorRegistry

from services.lifecycle import RoleStatus
from services.metrics import Metrics

PASS_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class ServeStatus(RoleStatus):
    source: str = ""                     # "snapshot": an exported folder; "online": the live servers
    model: str = ""                      # the model's import path
    checkpoint: Optional[str] = None     # what is served: the checkpoint it was exported from
    step: Optional[int] = None           # its step (online: ps0's updates applied at the last dense read)
    age_s: Optional[float] = None        # now minus the time of the newest update it reflects
    requests_answered: int = 0           # with predictions
    requests_refused: int = 0            # with an error (a bad row, too large, overloaded)
    rows_answered: int = 0
    forward_passes: int = 0              # rows_answered / forward_passes is the batching achieved
    cache: Optional[dict[str, Any]] = None   # online: rows cached, hits, misses, hit_rate, staleness_bound_s

    def line(self) -> list[str]:
        served = f"{self.source} {self.checkpoint or ''}".strip()
        age = [] if self.age_s is None else [f"age {self.age_s:.0f}s"]
        rows_per_pass = self.rows_answered / self.forward_passes if self.forward_passes else 0.0
        return [self.reason, served, *age, f"{self.requests_answered} answered", f"{rows_per_pass:.1f} rows a pass"]


class ServeMetrics(Metrics):
    def __init__(self, registry: CollectorRegistry, role: str, name: str) -> None:
        super().__init__(registry, role, name)
        self.request_seconds = self.histogram("rpcps_serve_request_seconds",
                                              "seconds from a /predict body read to its answer").labels(**self.labels)
        self._requests = self.counter("rpcps_serve_requests_total", "/predict requests by outcome (ok, invalid, "
                                                                    "too_large, overloaded, error)", ["outcome"])
        self.rows = self.counter("rpcps_serve_rows_total", "rows answered").labels(**self.labels)
        self.pass_rows = self.histogram("rpcps_serve_pass_rows", "rows a forward pass answered (concurrent "
                                                                 "requests batched)", buckets=PASS_ROWS
                                        ).labels(**self.labels)
        self.pass_seconds = self.histogram("rpcps_serve_pass_seconds", "seconds a forward pass took (encoding the "
                                                                       "rows, the model)").labels(**self.labels)
        self.age = self.gauge("rpcps_serve_age_seconds", "age of what is served: now minus the time of the newest "
                                                         "update it reflects (NaN: nothing served yet)")
        self.age.set(math.nan)
        self.cache_hits = self.counter("rpcps_serve_cache_hits_total", "online: rows a pass found in the cache within "
                                                                      "the staleness bound").labels(**self.labels)
        self.cache_misses = self.counter("rpcps_serve_cache_misses_total", "online: rows a pass read from the "
                                                                          "servers").labels(**self.labels)
        self.cache_rows = self.gauge("rpcps_serve_cache_rows", "online: rows in the cache")

    def request(self, outcome: str) -> Any:
        return self._requests.labels(outcome=outcome, **self.labels).inc()
