"""The step-time model of ``rpcps bench scale``: a trainer's step takes its compute, plus its
round trips times a latency, plus its bytes over its link's bandwidth, unless the servers are the
slower side (each has ``cpus`` cores for every trainer's requests):

    t = max(C + r·L + b/B,  N·σ / (S·q))

``C`` (CPU seconds a step over the host's ``q`` cores), ``r`` (RPCs a step), ``b`` (bytes a step
on its link) and ``σ`` (the servers' CPU seconds per trainer step) are measured in each run; only
the latency ``L`` is fitted (least squares over every run of a case). The fit's error at every
measured point is reported; projections to more hosts hold each case's measured terms at its
largest run."""
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
    """A run's measured terms, per trainer step (None: the run has no host figures)."""
    hosts, done, n, s = run["hosts"], run["done"], run["trainers"], run["servers"]
    trainers = [h for h in hosts.values() if h["role"] == run["client_role"]]
    servers = [h for h in hosts.values() if h["role"] in run["server_roles"]]
    step = (done.get("per_step") or {}).get("seconds", {}).get("total")
    if not trainers or not servers or not step:
        return None
    cores = sum(h["cores"] for h in trainers) / len(trainers)
    link = sum(h["link_bytes_per_s"] for h in trainers) / len(trainers)
    steps_per_s = n / step
    return {"t": step, "C": cores * step / cpus, "r": (done.get("per_step") or {}).get("rpcs", 0.0),
            "b": link * step, "B": bytes_per_s(run.get("link_rate")),
            "sigma": sum(h["cores"] for h in servers) / steps_per_s, "N": n, "S": s}


def predict(t: dict[str, float], latency: float, cpus: float) -> float:
    trainer = t["C"] + t["r"] * latency + (t["b"] / t["B"] if math.isfinite(t["B"]) else 0.0)
    return max(trainer, t["N"] * t["sigma"] / (t["S"] * cpus))


def fit(runs: list[dict[str, Any]], cpus: float) -> Optional[dict[str, Any]]:
    """The latency that best explains ``runs``' step times, and each run's predicted figure beside it."""
    measured = [(run, t) for run in runs if (t := terms(run, cpus)) is not None]
    if not measured:
        return None
    # The latency shows only where the trainers wait on their round trips, not on busy servers.
    free = [t for _, t in measured if t["N"] * t["sigma"] / (t["S"] * cpus) < SERVERS_BUSY * t["t"]]
    num = sum(t["r"] * (t["t"] - t["C"] - (t["b"] / t["B"] if math.isfinite(t["B"]) else 0.0)) for t in free)
    den = sum(t["r"] ** 2 for t in free)
    latency = max(0.0, num / den) if den else 0.0
    points = []
    for run, t in measured:
        step = predict(t, latency, cpus)
        points.append({"trainers": run["trainers"], "servers": run["servers"], "link_rate": run.get("link_rate"),
                       "measured_step_s": t["t"], "model_step_s": step, "error": step / t["t"] - 1})
    return {"latency_ms": 1e3 * latency, "points": points,
            "max_abs_error": max(abs(p["error"]) for p in points),
            "terms": {k: v for k, v in max(measured, key=lambda m: (m[1]["N"], m[1]["S"]))[1].items()
                      if k in ("C", "r", "b", "sigma")}}


def project(model: dict[str, Any], units_per_step: float, cpus: float, counts: list[int],
            rates: list[Optional[str]]) -> list[dict[str, Any]]:
    """Throughput at ``counts`` trainer hosts on each link rate, with the servers they need (the
    fewest whose share keeps the servers from being the slower side)."""
    terms_, latency = model["terms"], model["latency_ms"] / 1e3
    out = []
    for rate in rates:
        bandwidth = bytes_per_s(rate)
        step = terms_["C"] + terms_["r"] * latency + (terms_["b"] / bandwidth if math.isfinite(bandwidth) else 0.0)
        for n in counts:
            servers = max(1, math.ceil(n * terms_["sigma"] / (cpus * step)))
            out.append({"trainers": n, "servers": servers, "link_rate": rate, "step_s": step,
                        "per_s": n * units_per_step / step})
    return out
