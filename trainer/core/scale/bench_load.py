"""``python -m trainer.core.scale.bench_load URL ROWS CONCURRENCY SIZE STOP``: POST /predict at ``URL``
with ``CONCURRENCY`` requests of ``SIZE`` rows (from the JSON list in file ``ROWS``) always in
flight, until file ``STOP`` exists (or 30 minutes pass); prints rows/s and latency as JSON."""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

LIMIT_S = 1800.0


async def _run(url: str, rows: list[dict], concurrency: int, size: int, stop: Path) -> dict:
    took: list[float] = []
    refused: dict[str, int] = {}          # by status code (or the error's name)
    deadline = time.monotonic() + LIMIT_S

    async def worker(client: httpx.AsyncClient, k: int) -> None:
        at = k * size
        while not stop.exists() and time.monotonic() < deadline:
            body = {"rows": [rows[(at + j) % len(rows)] for j in range(size)]}
            at += size * concurrency
            started = time.perf_counter()
            try:
                code = str((await client.post("/predict", json=body)).status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            if code == "200":
                took.append(time.perf_counter() - started)
            else:
                refused[code] = refused.get(code, 0) + 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        began = time.monotonic()
        await asyncio.gather(*(worker(client, k) for k in range(concurrency)))
        seconds = time.monotonic() - began
    ordered = sorted(took)
    return {"seconds": round(seconds, 2), "requests": len(took), "refused": refused,
            "rows_per_s": len(took) * size / seconds if seconds else 0.0,
            "p50_ms": 1e3 * statistics.median(ordered) if ordered else None,
            "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))] if ordered else None}


if __name__ == "__main__":
    url, rows_file, concurrency, size, stop = sys.argv[1:6]
    print(json.dumps(asyncio.run(_run(url, json.loads(Path(rows_file).read_text()), int(concurrency), int(size),
                                      Path(stop)))))
