"""``rpcps bench scale``: how a job's throughput grows as trainer hosts are added, with every
member on an emulated host of its own (``supervise/hosts/``: its own network namespace and
address, PID and UTS namespaces, ``--cpus`` cores as a CFS quota, torch's threads set to match).
Needs root.

For each case the workloads declare (``ScaleCase``; ``--cases``):

* the baseline: one process (``rpcps up --local``) on one host of ``--cpus`` cores, the median of
  ``--baseline-rounds`` runs;
* ``--trainers`` trainer hosts with each of ``--servers`` server hosts, every one of ``--cpus``
  cores: throughput, **weak-scaling efficiency** (cluster / (trainer hosts x baseline)), and per
  host, while every trainer trained past its warm-up: cores used, the share of its quota's periods
  throttled (the proof the quota was the limit, not the shared machine), and its link's bytes per
  unit trained (a trainer's per its own units, a server's per the cluster's); each count run
  ``--rounds`` times, every count in turn each round, and judged on its median run;
* a case that is exact (sync): its held-out quality beside one process's on every trainer's
  samples (``rpcps up --local --num-trainers N``), at the most trainer hosts.

Then, at the most trainer and server hosts, each link variant beside its plain case on every one
of ``--rates`` (a token bucket on every host's link); a serving member on a host of its own
answering ``POST /predict`` at its peak (from a client held to ``--cpus`` cores) beside training
on 2 trainer hosts, against training alone; and the step-time model (``fit.py``) fitted on every
run, with its error at each, projected to ``--project`` trainer hosts. Prints JSON lines, the last
one the summary, whose ``met`` says which targets were reached; ``--plot`` draws the figure.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from services.workload import ScaleCase, resolve, roles, workloads
from trainer.core.scale import fit
from trainer.core.scale.runs import Load, Plan, cluster, one_process

QUALITY_EQUAL = 0.002           # |sync - one process| held-out AUC (or loss) counted as equal
SERVING_TARGET = 0.9            # training beside a serving host at its peak, against training alone
SERVING_TRAINERS = 2
TRAINER_CPU_TARGET = 1.0        # a trainer's CPU per unit, against one process's whole step


def cases() -> dict[str, tuple[ScaleCase, Any]]:
    """Every workload's cases, by name, with their workload's spec."""
    return {case.name: (case, spec) for spec in workloads().values() for case in spec.scale}


def add_arguments(p: argparse.ArgumentParser) -> None:
    swept = [n for n, (c, _) in cases().items() if c.against is None]
    variants = [n for n, (c, _) in cases().items() if c.against is not None]
    p.add_argument("--json", action="store_true", help="JSON lines only (the default output is JSON too)")
    p.add_argument("--cases", default=",".join(swept), help=f"cases run as hosts are added (of {', '.join(swept)})")
    p.add_argument("--trainers", default="1,2,3,4", help="trainer host counts")
    p.add_argument("--servers", default="1,2", help="server host counts, or auto: for each count of trainer hosts "
                                                    "the fewest the step-time model, fitted on the runs before, "
                                                    "says stay short of busy (1 for the first)")
    p.add_argument("--cpus", type=float, default=0.25, help="cores of every host (the hosts together should stay "
                                                           "well under the machine's cores)")
    p.add_argument("--steps", type=int, default=30, help="steps per trainer")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each trainer left out")
    p.add_argument("--baseline-rounds", type=int, default=3, choices=range(1, 10), metavar="N",
                   help="runs of each case's one-process baseline, whose median is the baseline (one run "
                        "varies by about 15 %% on a shared machine)")
    p.add_argument("--rounds", type=int, default=1, choices=range(1, 10), metavar="N",
                   help="runs of each count of trainer and server hosts, every count in turn each round; the "
                        "targets are judged on each count's median run (of two, the slower)")
    p.add_argument("--rates", default="none,1gbit,100mbit", help="link rates of the link variants (tc's units; "
                                                                 "none: unlimited; empty: no link sweep)")
    p.add_argument("--variants", default=",".join(variants), help=f"link variants (of {', '.join(variants)})")
    p.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                   help="measure training beside a serving host at its peak")
    p.add_argument("--project", default="8,16,32,64", help="trainer host counts the model projects to")
    p.add_argument("--plot", type=Path, default=None, help="draw throughput against trainer hosts into this PNG")
    p.add_argument("--refit", type=Path, default=None, help="fit the step-time model again on the JSON lines an "
                                                            "earlier run printed (makes no host, needs no root)")


def _counts(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()})


def _emit(record: dict) -> None:
    print(json.dumps({"bench": "scale", **record}), flush=True)


class Bench:
    def __init__(self, ns: argparse.Namespace, folder: Path) -> None:
        self.ns, self.folder = ns, folder
        self.trainers = _counts(ns.trainers)
        self.servers = None if ns.servers.strip() == "auto" else _counts(ns.servers)   # None: chosen
        self.chosen: dict[tuple[str, int], int] = {}      # --servers auto: (case, trainer hosts) -> server hosts
        self.runs: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.plans: dict[str, Plan] = {}

    def plan(self, case: ScaleCase, spec: Any) -> Plan:
        if case.name not in self.plans:
            flags, cwd = list(case.flags), None
            if case.prepare is not None:
                extra, cwd = resolve(case.prepare)(self.folder / case.name)
                flags += extra
            self.plans[case.name] = Plan(self.ns.cpus, self.ns.steps, self.ns.warmup, spec.server.client_role,
                                         case.unit, tuple(flags), cwd)
        return self.plans[case.name]

    def record(self, case: ScaleCase, plan: Plan, trainers: int, servers: int, result: dict[str, Any],
               baseline: Optional[float], link_rate: Optional[str] = None, kind: str = "hosts",
               round_: int = 0) -> dict[str, Any]:
        done, unit = result["done"], case.unit
        # While every trainer trained (else, a run too short to see that: the whole run's).
        per_s = result["window_per_s"] or done[f"{unit}_per_s"]
        hosts = result["hosts"]
        for h in hosts.values():      # a trainer's bytes and CPU per its own units; a server's per the cluster's
            own = per_s / trainers if h["role"] == plan.client_role else per_s
            h[f"bytes_per_{unit[:-1]}"] = h["link_bytes_per_s"] / own if own else None
            h[f"cpu_us_per_{unit[:-1]}"] = h["cores"] / own * 1e6 if own else None
        from trainer.core.allreduce import rounds     # (torch: only once a run is recorded)
        run = {"kind": kind, "case": case.name, "round": round_, "trainers": trainers, "servers": servers,
               "allreduce_hops": rounds(trainers),       # were its trainers to all-reduce
               "link_rate": link_rate, "per_s": per_s, "per_s_whole_run": done[f"{unit}_per_s"], "unit": unit,
               "quality": done.get(case.quality),
               "efficiency": per_s / (trainers * baseline) if baseline else None, **per_core(per_s, hosts, plan.cpus),
               "hosts": hosts,
               "done": {k: done.get(k) for k in ("per_step", "bytes_per_step", "steps", "restarts")}}
        if result.get("served") is not None:
            run["served"] = result["served"]
        self.runs.append(run)
        _emit(run)
        return run

    def attempt(self, what: dict[str, Any], run: Any, *args: Any, **kwargs: Any) -> Optional[dict[str, Any]]:
        """``run(*args)``, or None when it failed: the failure is printed and the bench goes on."""
        try:
            return run(*args, **kwargs)
        except (Exception, SystemExit) as exc:    # noqa: BLE001 - one run's failure, said; the others go on
            failure = {**what, "error": str(exc)[-3000:]}
            self.failures.append(failure)
            _emit(failure)
            return None

    def sweep(self, case: ScaleCase, spec: Any) -> Optional[dict[str, Any]]:
        plan = self.attempt({"kind": "prepare", "case": case.name}, self.plan, case, spec)
        if plan is None:
            return None
        bases = [base for _ in range(self.ns.baseline_rounds)
                 if (base := self.attempt({"kind": "baseline", "case": case.name}, one_process, plan)) is not None]
        if not bases:
            return None
        rate = f"{case.unit}_per_s"
        base = median_run(bases, lambda b: b["done"][rate])
        baseline = base["done"][rate]
        # One process uses its whole quota (its host's ``throttled`` says so): its CPU a unit is the quota's.
        per_core, cpu_us = baseline / plan.cpus, plan.cpus / baseline * 1e6
        _emit({"kind": "baseline", "case": case.name, "per_s": baseline, "unit": case.unit,
               "rounds": [b["done"][rate] for b in bases], "per_core": per_core,
               f"cpu_us_per_{case.unit[:-1]}": cpu_us, "quality": base["done"].get(case.quality), "host": base["host"]})
        out: dict[str, Any] = {"baseline": baseline, "baseline_per_core": per_core, "baseline_cpu_us_per_unit": cpu_us,
                               "client_role": plan.client_role, "baseline_host": base["host"], "runs": []}
        for round_ in range(self.ns.rounds):
            for trainers, servers in self.counts(case, out["runs"]):
                what = {"kind": "hosts", "case": case.name, "round": round_, "trainers": trainers, "servers": servers}
                result = self.attempt(what, cluster, plan, trainers, servers)
                if result is not None:
                    out["runs"].append(self.record(case, plan, trainers, servers, result, baseline, round_=round_))
        out["rounds"] = {f"{t}x{s}": [r["per_s"] for r in runs] for (t, s), runs in by_count(out["runs"]).items()}
        most = max(self.trainers)
        out["cpu_ms_per_step"] = cpu_by_phase(base["done"], out["runs"], most)
        reference = self.attempt({"kind": "one process", "case": case.name, "trainers": most}, one_process, plan,
                                 trainers=most, on_host=False) if case.exact else None
        if reference is not None:
            ref = reference["done"].get(case.quality)
            out["one_process_quality"] = ref
            out["quality_minus_one_process"] = {s: r["quality"] - ref for s, r in medians_at(out["runs"], most).items()
                                                if r["quality"] is not None and ref is not None}
        return out

    def counts(self, case: ScaleCase, runs: list[dict[str, Any]]) -> Iterator[tuple[int, int]]:
        """(trainer hosts, server hosts) of each of ``case``'s runs in a round, server counts
        outer; with ``--servers auto`` chosen from the runs so far as each comes."""
        if self.servers is not None:
            yield from ((t, s) for s in self.servers for t in self.trainers)
            return
        for trainers in self.trainers:
            key = (case.name, trainers)
            if key not in self.chosen:
                self.chosen[key] = servers_needed(case.name, runs, self.ns.cpus, trainers)
                _emit({"kind": "servers", "case": case.name, "trainers": trainers, "servers": self.chosen[key]})
            yield trainers, self.chosen[key]

    def servers_at(self, name: str, trainers: int) -> int:
        """The server hosts ``name``'s runs at ``trainers`` hosts had (a link variant: its plain
        case's): the most of ``--servers``, or those chosen."""
        if self.servers is not None:
            return max(self.servers)
        against = cases()[name][0].against or name
        return self.chosen.get((against, trainers), 1)

    def links(self, swept: dict[str, dict]) -> dict[str, Any]:
        rates = [r.strip() for r in self.ns.rates.split(",") if r.strip()]
        names = [v for v in self.ns.variants.split(",") if v]
        if not rates or not names:
            return {}
        known = cases()
        n = max(self.trainers)
        measured: dict[tuple[str, str], dict] = {}
        for name, result in swept.items():        # the plain cases' unlimited runs are the sweep's own
            for run in medians(result["runs"]):
                if run["trainers"] == n and run["servers"] == self.servers_at(name, n):
                    measured[(name, "none")] = run
        for rate in rates:
            for name in dict.fromkeys([c for v in names for c in (known[v][0].against, v)]):
                if (name, rate) in measured:
                    continue
                case, spec = known[name]
                plan, s = self.plan(case, spec), self.servers_at(name, n)
                result = self.attempt({"kind": "link", "case": name, "link_rate": rate}, cluster, plan, n, s,
                                      None if rate == "none" else rate)
                if result is None:
                    continue
                baseline = (swept.get(name) or {}).get("baseline")
                measured[(name, rate)] = self.record(case, plan, n, s, result, baseline,
                                                     None if rate == "none" else rate, kind="link")
        out: dict[str, Any] = {}
        for v in names:
            case = known[v][0]
            for rate in rates:
                mine, plain = measured.get((v, rate)), measured.get((case.against, rate))
                if mine and plain:
                    out.setdefault(v, {})[rate] = {"per_s": mine["per_s"], "against": case.against,
                                                   "against_per_s": plain["per_s"],
                                                   "ratio": mine["per_s"] / plain["per_s"]}
        return out

    def serving(self, swept: dict[str, dict]) -> Optional[dict[str, Any]]:
        found = [(c, spec) for c, spec in cases().values() if c.serve_rows and c.name in swept]
        if not self.ns.serve or not found:
            return None
        case, spec = found[0]
        n = SERVING_TRAINERS if SERVING_TRAINERS in self.trainers else min(self.trainers)
        plan, s = self.plan(case, spec), self.servers_at(case.name, n)
        alone = next((r for r in medians(swept[case.name]["runs"]) if r["trainers"] == n and r["servers"] == s), None)
        role = next(r.name for r in spec.roles if r.name != spec.server.client_role)
        rows = resolve(case.serve_rows)(4096)
        result = self.attempt({"kind": "serving", "case": case.name}, cluster, plan, n, s, extra=case.serve_flags,
                              serving=(role, lambda url: Load(rows, self.ns.cpus).start(url)))
        if result is None or alone is None:
            return None
        beside = self.record(case, plan, n, s, result, swept[case.name]["baseline"], kind="serving")
        return {"case": case.name, "trainers": n, "servers": s, "alone_per_s": alone["per_s"],
                "beside_per_s": beside["per_s"], "ratio": beside["per_s"] / alone["per_s"],
                "served": beside.get("served")}


def median_run(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    """The run of median ``key`` (of an even count, the lower of the middle two)."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def by_count(runs: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """``runs`` by their (trainer hosts, server hosts), rounds in order."""
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault((r["trainers"], r["servers"]), []).append(r)
    return out


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each count of hosts' median run over its rounds, by throughput (of two, the slower)."""
    return [median_run(rounds, lambda r: r["per_s"]) for rounds in by_count(runs).values()]


def per_core(per_s: float, hosts: dict[str, dict[str, Any]], cpus: float) -> dict[str, Optional[float]]:
    """Units a second per core: of the cores the hosts were given (what a cluster costs, servers
    included; one process's is its baseline ÷ ``cpus``), and of the cores they used meanwhile."""
    used = sum(h["cores"] for h in hosts.values())
    return {"per_core": per_s / (len(hosts) * cpus) if hosts else None, "per_core_used": per_s / used if used else None}


def trainer_cpu_ratio(result: dict[str, Any], unit: str, trainers: int) -> Optional[float]:
    """The trainers' mean CPU per unit at ``trainers`` hosts (the fewest servers measured), over
    one process's (its quota's cores, which it uses up: see its ``throttled``)."""
    runs = sorted((r for r in medians(result["runs"]) if r["trainers"] == trainers), key=lambda r: r["servers"])
    key, baseline = f"cpu_us_per_{unit[:-1]}", result.get("baseline_cpu_us_per_unit")
    spent = [h[key] for h in runs[0].get("hosts", {}).values()
             if h["role"] == result["client_role"] and h.get(key) is not None] if runs and baseline else []
    return sum(spent) / len(spent) / baseline if spent else None


def medians_at(runs: list[dict[str, Any]], most: int) -> dict[str, dict[str, Any]]:
    """By server hosts: the median run at ``most`` trainer hosts on unlimited links."""
    return {str(r["servers"]): r for r in medians(runs) if r["trainers"] == most and r["link_rate"] is None}


def cpu_by_phase(baseline: dict[str, Any], runs: list[dict[str, Any]], most: int) -> dict[str, Any]:
    """The training thread's CPU milliseconds a step, by phase: one process's (``baseline``, its
    ``done`` event) beside a trainer's in the median run at ``most`` trainer hosts, by server hosts.
    Each step is one trainer's batch in both, so the phases compare as they stand."""
    def ms(done: dict[str, Any]) -> dict[str, float]:
        return {k: round(v * 1e3, 3) for k, v in ((done.get("per_step") or {}).get("cpu_seconds") or {}).items()}
    return {"one_process": ms(baseline), "trainer": {s: ms(r["done"]) for s, r in medians_at(runs, most).items()}}


def quality_minus(runs: list[dict[str, Any]], others: list[dict[str, Any]], most: int) -> dict[str, float]:
    """By server hosts: the quality of the median run at ``most`` trainer hosts of ``runs``
    minus that of ``others``, where both have one."""
    mine, theirs = medians_at(runs, most), medians_at(others, most)
    return {s: r["quality"] - theirs[s]["quality"] for s, r in mine.items()
            if s in theirs and r["quality"] is not None and theirs[s]["quality"] is not None}


def _met(chosen: dict[str, ScaleCase], swept: dict[str, dict], links: dict[str, Any],
         serving: Optional[dict], most: int) -> tuple[dict[str, float], dict[str, bool]]:
    targets, met = {}, {}
    for name, result in swept.items():
        case = chosen[name]
        best = max((r["efficiency"] for r in medians(result["runs"]) if r["trainers"] == most and r["efficiency"]),
                   default=None)
        if case.efficiency is not None and best is not None:
            key = f"{name}_efficiency_at_{most}"
            targets[key], met[key] = case.efficiency, best >= case.efficiency
        ratio = trainer_cpu_ratio(result, case.unit, most)
        if ratio is not None:
            # A trainer's CPU per unit against one process's whole step: what running apart costs.
            key = f"{name}_trainer_cpu_per_unit_vs_one_process_at_{most}"
            targets[key], met[key] = TRAINER_CPU_TARGET, ratio <= TRAINER_CPU_TARGET
        for servers, diff in result.get("quality_minus_one_process", {}).items():
            key = f"{name}_quality_minus_one_process_{servers}_servers"
            targets[key], met[key] = QUALITY_EQUAL, abs(diff) <= QUALITY_EQUAL
        if case.quality_near is not None and case.quality_near[0] in swept:
            other, margin = case.quality_near
            for servers, diff in quality_minus(result["runs"], swept[other]["runs"], most).items():
                # How much worse it may be, in the quality's direction (an AUC: lower; a loss: higher).
                key = f"{name}_quality_minus_{other}_at_{most}_{servers}_servers"
                targets[key] = -margin if case.higher_is_better else margin
                met[key] = diff >= -margin if case.higher_is_better else diff <= margin
    known = cases()
    for variant, by_rate in links.items():
        target = known[variant][0].link_target
        slowest = min(by_rate, key=lambda r: fit.bytes_per_s(None if r == "none" else r), default=None)
        if target is not None and slowest is not None:
            key = f"{variant}_vs_{known[variant][0].against}_at_{slowest}"
            targets[key], met[key] = target, by_rate[slowest]["ratio"] >= target
    if serving is not None:
        targets["training_beside_serving"] = SERVING_TARGET
        met["training_beside_serving"] = serving["ratio"] >= SERVING_TARGET
    return targets, met


def servers_needed(name: str, runs: list[dict[str, Any]], cpus: float, trainers: int) -> int:
    """``--servers auto``: the server hosts ``trainers`` trainer hosts of case ``name`` need, as
    the step-time model fitted on ``runs`` projects them (1 before any run)."""
    model = fit.fit(_fitted(name, runs), cpus)
    return fit.project(model, 0.0, cpus, [trainers], [None])[0]["servers"] if model is not None else 1


def _fitted(name: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``name``'s runs the model fits, with the roles it tells trainers and servers apart by."""
    spec = cases()[name][1]
    return [{**r, "client_role": spec.server.client_role, "server_roles": _server_roles()} for r in runs
            if r["case"] == name and r["kind"] in ("hosts", "link")]


def _model(runs: list[dict[str, Any]], cpus: float, counts: list[int], rates: list[Optional[str]]) -> dict[str, Any]:
    """Each swept case's step-time model (``fit.py``), fitted on its runs and projected."""
    out = {}
    for name in dict.fromkeys(r["case"] for r in runs):
        case, spec = cases()[name]
        if case.against is not None:
            continue
        mine = _fitted(name, runs)
        model = fit.fit(mine, cpus)
        if model is None:
            continue
        largest = max(mine, key=lambda r: (r["trainers"], -r["done"]["per_step"]["seconds"]["total"]))
        step = largest["done"]["per_step"]["seconds"]["total"]
        model["projection"] = fit.project(model, largest["per_s"] / largest["trainers"] * step, cpus, counts, rates)
        out[name] = model
    return out


def _server_roles() -> list[str]:
    return [r.name for r in roles().values() if r.hosting]


def _rates(ns: argparse.Namespace) -> list[Optional[str]]:
    return [None] + [r for r in (r.strip() for r in ns.rates.split(",")) if r and r != "none"]


def refit(ns: argparse.Namespace) -> int:
    """``--refit FILE``: the model fitted again on the lines an earlier run printed; no host is made."""
    try:
        lines = [json.loads(line) for line in ns.refit.read_text().splitlines() if line.startswith("{")]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"rpcps bench scale --refit: cannot read {ns.refit}: {exc}") from None
    runs = [line for line in lines if line.get("bench") == "scale" and line.get("kind") in ("hosts", "link")]
    config = next((line["config"] for line in lines if "config" in line and "results" in line), {})
    cpus = config.get("cpus", ns.cpus)
    print(json.dumps({"bench": "scale", "refit": str(ns.refit), "model": _model(runs, cpus, _counts(ns.project),
                                                                               _rates(ns))}), flush=True)
    return 0


def run(ns: argparse.Namespace) -> int:
    if ns.refit is not None:
        return refit(ns)
    if os.geteuid() != 0:
        raise SystemExit("rpcps bench scale: emulated hosts need root (network namespaces and CPU quotas)")
    known = cases()
    names = [n for n in ns.cases.split(",") if n]
    unknown = sorted(set(names) - set(known)) + sorted(set(v for v in ns.variants.split(",") if v) - set(known))
    if unknown:
        raise SystemExit(f"rpcps bench scale: unknown cases {unknown}; choose from {', '.join(known)}")
    with tempfile.TemporaryDirectory(prefix="rpcps-scale-data-") as folder:
        bench = Bench(ns, Path(folder))
        swept = {name: result for name in names if (result := bench.sweep(*known[name])) is not None}
        links = bench.links(swept)
        serving = bench.serving(swept)
    most = max(bench.trainers)
    targets, met = _met({n: known[n][0] for n in names}, swept, links, serving, most)
    summary = {"bench": "scale", "results": swept, "links": links, "serving": serving, "failures": bench.failures,
               "model": _model(bench.runs, ns.cpus, _counts(ns.project), _rates(ns)), "targets": targets, "met": met,
               "config": {"cpus": ns.cpus, "steps": ns.steps, "warmup": ns.warmup,
                          "baseline_rounds": ns.baseline_rounds, "rounds": ns.rounds, "trainers": bench.trainers,
                          "servers": bench.servers or "auto",
                          "servers_chosen": {f"{c}@{t}": n for (c, t), n in bench.chosen.items()},
                          "machine_cpus": os.cpu_count(), "load_avg": os.getloadavg()}}
    if ns.plot is not None:
        from trainer.core.scale.plot import draw
        draw(summary, ns.plot)
        summary["plot"] = str(ns.plot)
    print(json.dumps(summary), flush=True)
    return 0
