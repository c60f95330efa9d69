"""The serving member: answers /predict with its source's model (an exported folder, or the live
servers read through a cache, joining their group), batching concurrent requests.

Threads: the sidecar's event loop (``predict``: check the rows, await the answer), the batcher's (every
forward pass), and the role thread (``run``: load the source, then wait to be stopped, beating the
group's heartbeat when online).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Optional

from ps.client.client import PsClient
from ps.spec.config import ps_names
from services.errors import InvalidInput, NotReady, NotSupported, Overloaded, RpcpsError, TooLarge
from services.lifecycle import RoleState
from services.role import RoleBase, RoleContext, WithoutEpisodes
from rpcps.model import models_from_here
from trainer.ctr.serving.batcher import MicroBatcher
from trainer.ctr.serving.config import ServeSettings
from trainer.ctr.serving.sources import Online, Snapshot, Source
from trainer.ctr.serving.status import ServeMetrics

log = logging.getLogger(__name__)

_OUTCOMES = ((TooLarge, "too_large"), (InvalidInput, "invalid"), (Overloaded, "overloaded"))
NO_CHECKPOINTS = "a serving member holds nothing a checkpoint keeps: ask ps0 or a trainer"


class ServeRole(WithoutEpisodes, RoleBase):
    role = "serve"
    no_episodes = "a serving member runs no episodes: {} them on the trainers"
    metrics: ServeMetrics

    def __init__(self, cfg: ServeSettings, ctx: RoleContext,
                 open_source: Optional[Callable[[ServeSettings], Source]] = None) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self.body_bytes = cfg.body_bytes          # the route refuses a larger body before reading it all
        self._open = open_source or self._opened
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)       # woken by nothing but time: joining polls
        self._stopping = threading.Event()
        self._source: Optional[Source] = None
        self._batcher: Optional[MicroBatcher[Any, Any]] = None
        self._counted = (0, 0)          # the cache's hits and misses the metrics have counted
        self._counts = {"requests_answered": 0, "requests_refused": 0, "rows_answered": 0, "forward_passes": 0}

    def _opened(self, cfg: ServeSettings) -> Source:
        """The model as ``cfg`` says: an exported folder, or the live servers' (joining their group)."""
        models_from_here()
        if not cfg.online:
            return Snapshot(cfg.snapshot, cfg.request_rows)
        self._join("joining the cluster")
        servers = ps_names(cfg.num_ps)
        self._await_members(servers, cfg.join_timeout, self._wake, self._stopping.is_set)
        client = PsClient(cfg.name, servers, timeout=cfg.read_timeout)
        return Online(client, cfg.request_rows, cfg.staleness, cfg.cache_rows, cfg.data)

    def run(self) -> None:
        self.board.set_state(RoleState.STARTING, "loading the model")
        source = self._open(self.cfg)
        served = source.served()
        with self._lock:
            self._source = source
            self._batcher = MicroBatcher(source.answer, self.cfg.batch_rows, self.cfg.batch_wait_ms / 1000,
                                         self.cfg.queue_rows, self._passed)
        self.metrics.age.set_function(lambda: source.served().age())
        self.board.update(source=served.source, model=source.model_ref, checkpoint=served.checkpoint, step=served.step)
        self.metrics.up.set(1)
        self.board.set_state(RoleState.RUNNING, f"serving {served.source}")
        log.info("serving %s (%s)", source.model_ref, served.header())
        while not self._stopping.wait(1.0):
            if self.endpoint is not None and self.endpoint.joined:
                self._heartbeat()

    def _passed(self, rows: int, seconds: float) -> None:
        """After each forward pass, in the batcher's thread (the one that uses the cache)."""
        self.metrics.pass_rows.observe(rows)
        self.metrics.pass_seconds.observe(seconds)
        cache = self._source.cache if self._source is not None else None
        if cache is not None:
            self.metrics.cache_hits.inc(cache.hits - self._counted[0])
            self.metrics.cache_misses.inc(cache.misses - self._counted[1])
            self.metrics.cache_rows.set(cache.size)
            self._counted = (cache.hits, cache.misses)
        with self._lock:
            self._counts["forward_passes"] += 1

    async def predict(self, body: Any) -> tuple[dict[str, Any], str]:
        """A probability per row of ``body`` (``{"rows": [...]}``), and what answered them (the
        ``X-Rpcps-Served`` header). Awaited on the sidecar's event loop: the rows are checked there
        and the answer awaited without holding a thread, so many requests can wait for one pass."""
        started = time.perf_counter()
        with self._lock:
            source, batcher = self._source, self._batcher
        if source is None or batcher is None:
            raise NotReady(f"not serving yet: {self.board.snapshot()['reason']}")
        try:
            rows = source.rows.rows(body)
            try:
                scores, served = await asyncio.wait_for(asyncio.wrap_future(batcher.submit(rows)),
                                                        self.cfg.request_timeout)
            except asyncio.TimeoutError:
                raise Overloaded(f"no answer within {self.cfg.request_timeout:g}s (--request-timeout): the member "
                                 f"is overloaded") from None
        except Exception as exc:
            self._refused(exc)
            raise
        self.metrics.request_seconds.observe(time.perf_counter() - started)
        self.metrics.request("ok")
        self.metrics.rows.inc(len(rows))
        with self._lock:
            self._counts["requests_answered"] += 1
            self._counts["rows_answered"] += len(rows)
        return {"predictions": scores, "served": served.described()}, served.header()

    def refuse_body(self, exc: RpcpsError) -> None:
        """A body the route refused before it reached ``predict`` (too large, not JSON)."""
        self._refused(exc)

    def _refused(self, exc: BaseException) -> None:
        outcome = next((o for kind, o in _OUTCOMES if isinstance(exc, kind)), "error")
        self.metrics.request(outcome)
        with self._lock:
            self._counts["requests_refused"] += 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            source, counts = self._source, dict(self._counts)
        if source is not None:
            served, cache = source.served(), source.cache
            if cache is not None:
                looked = cache.hits + cache.misses
                counts["cache"] = {"rows": cache.size, "hits": cache.hits, "misses": cache.misses,
                                   "hit_rate": round(cache.hits / looked, 4) if looked else None,
                                   "staleness_bound_s": self.cfg.staleness}
            self.board.update(age_s=round(served.age(), 3) if served.updated_at else None, step=served.step,
                              **counts)
        return super().status()

    def checkpoint(self) -> dict[str, Any]:
        raise NotSupported(NO_CHECKPOINTS)

    def list_checkpoints(self) -> list[dict[str, Any]]:
        raise NotSupported(NO_CHECKPOINTS)

    def request_stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        self.metrics.up.set(0)
        self.board.set_state(RoleState.STOPPING, "stopping")
        with self._lock:
            batcher = self._batcher
        if batcher is not None:
            batcher.close()
        if self.endpoint is not None and self.endpoint.joined:
            self._leave()
