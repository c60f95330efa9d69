"""`rpcps bench serve`: the serving member's latency, throughput, freshness and cost to training,
printing JSON. The built-in DLRM on Criteo-format files at ``--scale`` (two servers, two
trainers), its rows sent as JSON rows from this process, from either source:

* snapshot: a run of the cluster exported, `rpcps serve --snapshot` over it; the cost to training
  is the cluster's samples/s in runs alone and beside the batched load, interleaved ``--rounds``
  times;
* online: `rpcps up --serve 1`, training without end while it is measured; freshness by a marker
  (training paused until the served prediction holds still, then resumed: the time to the first
  prediction that moves); the cost is the trainers' steps/s in windows alone and beside the load.

Each measures latency (one request in flight, one row: p50, p99) and throughput (``--concurrency``
requests in flight, of one row each and of ``--request-rows`` rows each: rows/s, p50 and p99, rows
a forward pass).

Everything runs on this machine, so the load generator, the serving member and the cluster share
its cores: the cost to training is what one machine pays, not what a separate serving host costs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import numpy as np

from supervise.processes import free_port, spawn_role, stop_in_waves


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
    p.add_argument("--source", choices=("snapshot", "online", "both"), default="both", help="which source to measure")
    p.add_argument("--staleness", type=float, default=1.0, help="online: the serving member's staleness bound (s)")
    p.add_argument("--marks", type=int, default=5, help="online: freshness measured this many times")


def _cli(*args: str, timeout: float = 1800) -> str:
    done = subprocess.run([sys.executable, "-m", "supervise.cli", *args], capture_output=True, text=True,
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
    from rpcps.data.generated import CATEGORICAL, DENSE       # loads torch: not when the CLI lists commands
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
    sources = ("snapshot", "online") if ns.source == "both" else (ns.source,)
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-serve-") as name:
        tmp = Path(name)
        _cli("data", "ctr", "--rows", str(ns.lines), "--scale", str(ns.scale), "--out", str(tmp / "data"))
        rows = _rows(tmp / "data", 4096)
        result: dict[str, Any] = {"bench": "serve", "scale": ns.scale}
        if "snapshot" in sources:
            result["snapshot"] = _snapshot(tmp, ns, rows)
        if "online" in sources:
            result["online"] = _online(tmp, ns, rows)
    print(json.dumps(result))
    return 0


def _measured(url: str, rows: list[dict], ns: argparse.Namespace) -> dict[str, Any]:
    return {"one_row": latency(url, rows, ns.requests),
            "one_row_many_in_flight": throughput(url, rows, argparse.Namespace(**{**vars(ns), "request_rows": 1})),
            "batched": throughput(url, rows, ns)}


def _snapshot(tmp: Path, ns: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    """The exported model, served alone; then the cluster's training alone and beside its load."""
    trained = _train(tmp, ns, "first")
    _cli("export", "--checkpoint", str(tmp / "ck-first"), "--out", str(tmp / "model"))
    port = free_port()
    serve = spawn_role("supervise.cli", ["serve", "--snapshot", str(tmp / "model"), "--sidecar-port", str(port),
                                        "--checkpoint-dir", str(tmp / "ck-serve")], tmp / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _ready(url), 120, lambda: serve.poll() is None, tmp / "serve.log")
        found: dict[str, Any] = {"trained": {"samples_per_s": trained["samples_per_s"], "auc": trained["auc"]}}
        found.update(_measured(url, rows, ns))
        found["training"] = _cost(tmp, ns, url, rows)
    finally:
        stop_in_waves([[("serve0", serve)]], timeout=15)
    return found


def _online(tmp: Path, ns: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    """A cluster training without end with a serving member reading its servers: latency and
    throughput while it trains, freshness by marker, and the trainers' steps/s with and without
    the batched load."""
    state = tmp / "state-online"
    argv = [sys.executable, "-m", "supervise.cli", "up", "--workload", "ctr", "--scale", str(ns.scale), "--data",
            str(tmp / "data"), "--num-ps", "2", "--num-trainers", "2", "--batch-size", "2048", "--eval-samples", "0",
            "--serve", "1", "--serve-staleness", str(ns.staleness), "--checkpoint-dir", str(tmp / "ck-online"),
            "--state-dir", str(state), "--no-final-checkpoint", "--progress-interval", "60", "--json"]
    with open(tmp / "up-online.log", "w") as log:
        up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        cluster: dict[str, Any] = {}

        def started() -> bool:
            cluster.update(json.loads((state / "cluster.json").read_text()) if (state / "cluster.json").exists()
                           else {})
            return "serve0" in cluster.get("sidecars", {}) and _ready(cluster["sidecars"]["serve0"]) \
                and all(_ready(u) for u in cluster["sidecars"].values())
        _wait(started, 600, lambda: up.poll() is None, tmp / "up-online.log")
        url = cluster["sidecars"]["serve0"]
        trainers = [u for n, u in cluster["sidecars"].items() if n.startswith("ctr")]
        found = {"staleness_bound_s": ns.staleness, **_measured(url, rows, ns)}
        found["cache"] = httpx.get(f"{url}/status").json().get("cache")
        found["freshness"] = _freshness(url, trainers, rows, ns)
        found["training"] = _online_cost(url, trainers, rows, ns)
        return found
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


def _episodes(trainers: list[str], action: str) -> None:
    for url in trainers:
        httpx.post(f"{url}/episode/{action}", timeout=30).raise_for_status()
    wanted = "idle" if action == "stop" else "running"
    _wait(lambda: all(httpx.get(f"{u}/status").json()["state"] == wanted for u in trainers), 120, lambda: True)


def _freshness(url: str, trainers: list[str], rows: list[dict], ns: argparse.Namespace) -> dict[str, Any]:
    """The marker: training paused until the served prediction of a row holds still past the bound,
    then resumed; the time from the resume request to the first prediction that differs. It holds
    the trainers' first step after the pause as well: an upper bound on update-to-served."""
    body = {"rows": [rows[0]]}
    took = []
    with httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(socket_options=NO_DELAY)) as client:
        for _ in range(ns.marks):
            _episodes(trainers, "stop")
            still = client.post("/predict", json=body).json()["predictions"]
            quiet = time.monotonic() + 2 * ns.staleness + 0.5
            while time.monotonic() < quiet:
                now = client.post("/predict", json=body).json()["predictions"]
                if now != still:
                    still, quiet = now, time.monotonic() + 2 * ns.staleness + 0.5
            resumed = time.monotonic()
            for trainer in trainers:
                httpx.post(f"{trainer}/episode/start", json={}, timeout=30).raise_for_status()
            while client.post("/predict", json=body).json()["predictions"] == still:
                if time.monotonic() - resumed > 60:
                    raise RuntimeError("no prediction moved within 60 s of training resuming")
            took.append(time.monotonic() - resumed)
    return {"marks": len(took), "median_s": round(float(np.median(took)), 3), "max_s": round(max(took), 3)}


def _steps(trainers: list[str]) -> int:
    return sum(httpx.get(f"{u}/status").json().get("step", 0) for u in trainers)


def _online_cost(url: str, trainers: list[str], rows: list[dict], ns: argparse.Namespace) -> dict[str, Any]:
    """The trainers' steps/s over ``--seconds`` alone and beside the batched load, alternated."""
    alone, beside, served = [], [], []
    for _ in range(ns.rounds):
        at, started = _steps(trainers), time.monotonic()
        time.sleep(ns.seconds)  # noqa: sleep-ok (a measuring window: the time itself is what is measured)
        alone.append((_steps(trainers) - at) / (time.monotonic() - started))
        at, started = _steps(trainers), time.monotonic()
        found = throughput(url, rows, ns)
        beside.append((_steps(trainers) - at) / (time.monotonic() - started))
        served.append(found["rows_per_s"])
    return {"steps_per_s_alone": [round(v, 2) for v in alone],
            "steps_per_s_beside_serving": [round(v, 2) for v in beside],
            "serving_rows_per_s_meanwhile": served, "ratio": round(float(np.median(beside) / np.median(alone)), 3)}


def _wait(done: Callable[[], bool], timeout: float, alive: Callable[[], bool], log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if not alive() or time.monotonic() > deadline:
            said = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"did not come up within {timeout:.0f}s: {said}")
        time.sleep(0.2)  # noqa: sleep-ok (polling readiness with a deadline)


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
