"""The step-time model of ``rpcps bench scale``: a trainer's step takes its compute, plus its
round trips times a latency, plus (where the trainers all-reduce) the hops of the ring times a
hop's wait, plus its bytes over its link's bandwidth, unless the servers are the slower side (each
has ``cpus`` cores for every trainer's requests):

    t = max(C + r·L + h(N)·H + b/B,  N·σ / (S·q))

``h(N)`` is the exchanges of the trainers' all-reduce (``trainer/core/allreduce.py``): gloo's ring,
2(N - 1), up to 5 trainers; halving and doubling, 2·log2(N) (two more off a power of two), from 6.
A run records the count it ran with (a run recorded before, without it, ran the ring).

``C`` (CPU seconds a step over the host's ``q`` cores), ``r`` (RPCs a step), ``b`` (bytes a step
on its link, the busier way: a link carries each way at its rate) and ``σ`` (the servers' CPU
seconds per trainer step) are measured in each run; only the latency ``L`` and the hop ``H`` are
fitted (least squares over the runs whose servers were not the slower side).
The fit's error at every measured point is reported. Projections to more hosts hold the terms of
the fastest run with the most trainers: a trainer's CPU a step is held as measured there, though
a trainer that talks to more servers spends more on messages (the DLRM's trainers, 4 of them,
took 25–31 % longer a step with 2 server hosts than with 1), so they are an upper bound."""
from __future__ import annotations

import math
from typing import Any, Optional

BITS = {"k": 1e3, "m": 1e6, "g": 1e9}
SERVERS_BUSY = 0.9      # servers this busy (of the step's time) are the slower side: no latency is read there


def bytes_per_s(rate: Optional[str]) -> float:
    """A link rate in tc's units as bytes a second (None: unlimited, infinite)."""
    if rate is None:
        return math.inf
    number = rate.removesuffix("bit")
    scale = BITS.get(number[-1:], 1.0)
    return float(number.rstrip("kmg")) * scale / 8


def terms(run: dict[str, Any], cpus: float) -> Optional[dict[str, float]]:
    """A run's measured terms, per trainer step (None: the run has no host figures, or its link
    was capped and its two ways were not recorded apart)."""
    hosts, done, n, s = run["hosts"], run["done"], run["trainers"], run["servers"]
    trainers = [h for h in hosts.values() if h["role"] == run["client_role"]]
    servers = [h for h in hosts.values() if h["role"] in run["server_roles"]]
    step = (done.get("per_step") or {}).get("seconds", {}).get("total")
    bandwidth = bytes_per_s(run.get("link_rate"))
    apart = all("link_rx_bytes_per_s" in h for h in trainers)
    if not trainers or not servers or not step or (math.isfinite(bandwidth) and not apart):
        return None
    cores = sum(h["cores"] for h in trainers) / len(trainers)
    # A link carries each way at its rate: the busier direction is what a step waits for.
    link = sum(max(h["link_rx_bytes_per_s"], h["link_tx_bytes_per_s"]) for h in trainers) / len(trainers) \
        if apart else 0.0
    # An all-reduce among N trainers waits on each of its exchanges, each on a peer that may be busy.
    hops = run.get("allreduce_hops", 2 * (n - 1)) if (done.get("bytes_per_step") or {}).get("allreduce") else 0
    return {"t": step, "C": cores * step / cpus, "r": (done.get("per_step") or {}).get("rpcs", 0.0),
            "h": hops, "b": link * step, "B": bandwidth,
            "sigma": sum(h["cores"] for h in servers) / (n / step), "N": n, "S": s}


def _wire(t: dict[str, float]) -> float:
    return t["b"] / t["B"] if math.isfinite(t["B"]) else 0.0


def predict(t: dict[str, float], latency: float, hop: float, cpus: float) -> float:
    trainer = t["C"] + t["r"] * latency + t["h"] * hop + _wire(t)
    return max(trainer, t["N"] * t["sigma"] / (t["S"] * cpus))


def _least_squares(free: list[dict[str, float]]) -> tuple[float, float]:
    """The latency a round trip and the wait a ring hop (both at least 0) that best explain the
    time ``free``'s steps spent beyond their compute and their bytes."""
    rest = [t["t"] - t["C"] - _wire(t) for t in free]
    rr = sum(t["r"] ** 2 for t in free)
    hh = sum(t["h"] ** 2 for t in free)
    rh = sum(t["r"] * t["h"] for t in free)
    ry = sum(t["r"] * y for t, y in zip(free, rest))
    hy = sum(t["h"] * y for t, y in zip(free, rest))
    det = rr * hh - rh * rh
    if det > 1e-12:
        latency, hop = (ry * hh - hy * rh) / det, (hy * rr - ry * rh) / det
        if latency >= 0 and hop >= 0:
            return latency, hop
    # One of them alone (the other held at 0), whichever explains more.
    alone = [(max(0.0, ry / rr) if rr else 0.0, 0.0), (0.0, max(0.0, hy / hh) if hh else 0.0)]
    return min(alone, key=lambda lh: sum((y - t["r"] * lh[0] - t["h"] * lh[1]) ** 2 for t, y in zip(free, rest)))


def fit(runs: list[dict[str, Any]], cpus: float) -> Optional[dict[str, Any]]:
    """The latency (and ring hop) that best explain ``runs``' step times, and each run's predicted
    step beside it."""
    measured = [(run, t) for run in runs if (t := terms(run, cpus)) is not None]
    if not measured:
        return None
    # Waits show only where the trainers wait on their round trips, not on busy servers.
    free = [t for _, t in measured if t["N"] * t["sigma"] / (t["S"] * cpus) < SERVERS_BUSY * t["t"]]
    latency, hop = _least_squares(free) if free else (0.0, 0.0)
    points = []
    for run, t in measured:
        step = predict(t, latency, hop, cpus)
        points.append({"trainers": run["trainers"], "servers": run["servers"], "link_rate": run.get("link_rate"),
                       "measured_step_s": t["t"], "model_step_s": step, "error": step / t["t"] - 1})
    # Projections hold the terms of the fastest run with the most trainers, on an unlimited link.
    most = max(t["N"] for _, t in measured)
    best = min((t for _, t in measured if t["N"] == most), key=lambda t: (math.isfinite(t["B"]), t["t"]))
    return {"latency_ms": 1e3 * latency, "ring_hop_ms": 1e3 * hop, "points": points,
            "max_abs_error": max(abs(p["error"]) for p in points),
            "terms": {k: v for k, v in best.items() if k in ("C", "r", "h", "b", "sigma", "N", "S")}}


def project(model: dict[str, Any], units_per_step: float, cpus: float, counts: list[int],
            rates: list[Optional[str]]) -> list[dict[str, Any]]:
    """Throughput at ``counts`` trainer hosts on each link rate, with the servers they need (the
    fewest whose share keeps the servers from being the slower side)."""
    from trainer.core.allreduce import rounds     # (torch: only once a projection is made)
    terms_, latency, hop = model["terms"], model["latency_ms"] / 1e3, model["ring_hop_ms"] / 1e3
    out = []
    for rate in rates:
        bandwidth = bytes_per_s(rate)
        for n in counts:
            hops = rounds(n) if terms_["h"] else 0
            step = terms_["C"] + terms_["r"] * latency + hops * hop + \
                (terms_["b"] / bandwidth if math.isfinite(bandwidth) else 0.0)
            # The fewest servers that stay short of busy (as those of the held run were, or not).
            servers = max(1, math.ceil(n * terms_["sigma"] / (SERVERS_BUSY * cpus * step)))
            out.append({"trainers": n, "servers": servers, "link_rate": rate, "step_s": step,
                        "per_s": n * units_per_step / step})
    return out
