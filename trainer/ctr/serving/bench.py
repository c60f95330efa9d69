"""`rpcps bench serve`: the serving member's latency, throughput and cost to training, printing JSON.

It trains the built-in DLRM on Criteo-format files at ``--scale`` (two servers, two trainers),
exports the checkpoint, starts `rpcps serve --snapshot` over it, and sends it the files' lines as
JSON rows from this process:

* latency: one request in flight, one row a request (p50, p99);
* throughput: ``--concurrency`` requests in flight, of one row each and of ``--request-rows``
  rows each (rows/s, p50 and p99 of a request, rows a forward pass);
* cost to training: the cluster's samples/s alone, and again while the load of the throughput
  phase runs beside it (the runs interleaved ``--rounds`` times).

Everything runs on this machine, so the load generator, the serving member and the cluster share
its cores: the cost to training is what one machine pays, not what a separate serving host costs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import numpy as np

from services.processes import free_port, spawn_role, stop_in_waves
from trainer.ctr.criteo import CATEGORICAL
from trainer.ctr.synthetic import DENSE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON lines only (the default output is JSON too)")
    p.add_argument("--scale", type=float, default=0.1, help="Criteo Kaggle's cardinalities times this")
    p.add_argument("--lines", type=int, default=60_000, help="lines of Criteo-format data written and trained on")
    p.add_argument("--steps", type=int, default=30, help="training steps per trainer (each run)")
    p.add_argument("--requests", type=int, default=1000, help="one-row requests timed one at a time")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of the throughput phase")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight in the throughput phases")
    p.add_argument("--request-rows", type=int, default=64, help="rows a request in the batched phase (the other "
                                                                "sends one)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of training alone and beside serving")


def _cli(*args: str, timeout: float = 1800) -> str:
    done = subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"rpcps {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _train(tmp: Path, ns: argparse.Namespace, tag: str) -> dict[str, Any]:
    """A training run of the cluster; its done event."""
    out = _cli("up", "--workload", "ctr", "--scale", str(ns.scale), "--data", str(tmp / "data"), "--json",
               "--num-ps", "2", "--num-trainers", "2", "--steps", str(ns.steps), "--batch-size", "2048",
               "--eval-samples", "4096", "--checkpoint-dir", str(tmp / f"ck-{tag}"), "--state-dir",
               str(tmp / f"state-{tag}"), "--progress-interval", "60")
    return [json.loads(line) for line in out.splitlines() if '"done"' in line][-1]


def _rows(data: Path, count: int) -> list[dict[str, Any]]:
    """The first ``count`` lines of ``data`` as a client sends them: counts as integers, values as
    strings, empty fields as null."""
    rows = []
    with (sorted(data.iterdir())[0]).open() as f:
        for _, line in zip(range(count), f):
            fields = line.rstrip("\n").split("\t")
            row = {f"I{j + 1}": int(v) if v else None for j, v in enumerate(fields[1:1 + DENSE])}
            row.update({f"C{t + 1}": v or None for t, v in enumerate(fields[1 + DENSE:1 + DENSE + CATEGORICAL])})
            rows.append(row)
    return rows


def _ms(seconds: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(seconds, 50)) * 1000, 3),
            "p99_ms": round(float(np.percentile(seconds, 99)) * 1000, 3)}


# A client that writes a request's headers and body apart waits out the server's delayed ACK
# (40 ms on Linux) unless Nagle's algorithm is off, as curl and most HTTP libraries turn it off.
NO_DELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def latency(url: str, rows: list[dict], requests: int) -> dict[str, Any]:
    took = []
    with httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(socket_options=NO_DELAY)) as client:
        for k in range(requests + 20):
            started = time.perf_counter()
            answer = client.post("/predict", json={"rows": [rows[k % len(rows)]]})
            if k >= 20:                                   # the first ones warm the connection and caches
                took.append(time.perf_counter() - started)
            answer.raise_for_status()
    return {"requests": requests, **_ms(took)}


async def _load(url: str, rows: list[dict], concurrency: int, size: int, seconds: float,
                stop: Optional[threading.Event]) -> dict[str, Any]:
    took: list[float] = []
    refused = 0
    deadline = time.monotonic() + seconds

    async def worker(k: int) -> None:
        nonlocal refused
        at = k * size
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            body = {"rows": [rows[(at + j) % len(rows)] for j in range(size)]}
            at += size * concurrency
            started = time.perf_counter()
            answer = await client.post("/predict", json=body)
            if answer.status_code == 200:
                took.append(time.perf_counter() - started)
            else:
                refused += 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    transport = httpx.AsyncHTTPTransport(socket_options=NO_DELAY, limits=limits)
    async with httpx.AsyncClient(base_url=url, timeout=30, transport=transport) as client:
        started = time.monotonic()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        elapsed = time.monotonic() - started
    return {"concurrency": concurrency, "request_rows": size, "seconds": round(elapsed, 2),
            "rows_per_s": round(len(took) * size / elapsed, 1), "refused": refused, **_ms(took or [0.0])}


def throughput(url: str, rows: list[dict], ns: argparse.Namespace, stop: Optional[threading.Event] = None
               ) -> dict[str, Any]:
    before = httpx.get(f"{url}/status").json()
    found = asyncio.run(_load(url, rows, ns.concurrency, ns.request_rows, ns.seconds, stop))
    after = httpx.get(f"{url}/status").json()
    passes = after["forward_passes"] - before["forward_passes"]
    found["rows_per_pass"] = round((after["rows_answered"] - before["rows_answered"]) / max(passes, 1), 1)
    return found


def run(ns: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-serve-") as name:
        tmp = Path(name)
        _cli("data", "ctr", "--rows", str(ns.lines), "--scale", str(ns.scale), "--out", str(tmp / "data"))
        trained = _train(tmp, ns, "first")
        _cli("export", "--checkpoint", str(tmp / "ck-first"), "--out", str(tmp / "model"))
        port = free_port()
        serve = spawn_role("services.cli", ["serve", "--snapshot", str(tmp / "model"), "--sidecar-port", str(port),
                                            "--checkpoint-dir", str(tmp / "ck-serve")], tmp / "serve.log")
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while not _ready(url):
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"rpcps serve did not start: {(tmp / 'serve.log').read_text()[-2000:]}")
                time.sleep(0.2)  # noqa: sleep-ok (polling a process's readiness with a deadline)
            rows = _rows(tmp / "data", 4096)
            result: dict[str, Any] = {"bench": "serve", "source": "snapshot", "scale": ns.scale,
                                      "trained": {"samples_per_s": trained["samples_per_s"], "auc": trained["auc"]}}
            result["one_row"] = latency(url, rows, ns.requests)
            result["one_row_many_in_flight"] = throughput(url, rows, argparse.Namespace(**{**vars(ns),
                                                                                         "request_rows": 1}))
            result["batched"] = throughput(url, rows, ns)
            result["training"] = _cost(tmp, ns, url, rows)
        finally:
            stop_in_waves([[("serve0", serve)]], timeout=15)
    print(json.dumps(result))
    return 0


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _cost(tmp: Path, ns: argparse.Namespace, url: str, rows: list[dict]) -> dict[str, Any]:
    """Training's samples/s alone and beside the throughput phase's load, interleaved."""
    alone, beside, served = [], [], []
    for k in range(ns.rounds):
        alone.append(_train(tmp, ns, f"alone{k}")["samples_per_s"])
        stop = threading.Event()
        loaded = argparse.Namespace(**{**vars(ns), "seconds": 3600.0})
        found: dict[str, Any] = {}
        load = threading.Thread(target=lambda: found.update(throughput(url, rows, loaded, stop)), daemon=True)
        load.start()
        try:
            beside.append(_train(tmp, ns, f"beside{k}")["samples_per_s"])
        finally:
            stop.set()
            load.join(60)
        served.append(found.get("rows_per_s", 0.0))
    return {"samples_per_s_alone": alone, "samples_per_s_beside_serving": beside,
            "serving_rows_per_s_meanwhile": served,
            "ratio": round(float(np.median(beside)) / float(np.median(alone)), 3)}
