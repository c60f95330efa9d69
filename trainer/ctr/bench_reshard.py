"""``rpcps bench reshard``: servers added to and removed from a training job, live, against the way
without live moves (stop with a final checkpoint, start again with the new count), in one run.

The built-in DLRM trains under ``rpcps up`` (generated Criteo data at ``--scale``, ``--trainers``
trainers, ``--servers`` servers, ``--consistency``). While every trainer's step counter is read
each ``--sample`` seconds, ``rpcps scale --servers N+1`` moves the job onto one more server (which
``rpcps up`` starts), and ``--servers N`` moves it back. Then the job is stopped (SIGTERM: the final
checkpoint) and started again on N+1 servers from that checkpoint, timed from the signal to each
trainer's first step.

For each move it prints: the leader's figures (slots, bytes, the trainers' hold, seconds); the
longest time a trainer's counter stood still from the request to the end of the move, against the
median step before; samples/s in the ``--window`` before the request and in the same length from
it. ``met`` holds the targets: a move's longest step within 0.5 s of the median step, samples/s
in the window from the move's start (once its servers serve) at least 0.7 of before (the window
from the request, with a new server's start, is beside it), and the time without training at least 20 times shorter than the
restart's. ``limits`` says what bounded it: the bytes moved, the load, the cores.

With ``--emulate-hosts`` every member runs on an emulated host of its own, and each move also
reports what every host's link sent from its request to its end (``link``); with ``--link-rate``
(each host's outgoing link capped, as a 1 Gbit network would), ``met`` also holds the move's time
against its bytes over that rate: at most 1.5 times that, plus 5 s.

With ``--compare-steps N`` (sync, or one trainer) the job trains N steps with the moves among
them, and the same job again without a move; both are exported (``rpcps export``) and ``met``
says whether every table and dense tensor is the same, bit for bit (``compared``).

With ``--count-updates`` (async or ssp, any number of trainers) the servers count each row's
updates and the trainers their acknowledged steps' (``ps/spec/counting.py``); once the moves are
measured the trainers are stopped, and ``counted`` says, slot by slot, how many acknowledged row
updates no row holds (``lost``) and how many a row holds past every step that could have made them
(``twice``); ``met`` says whether both are zero.

A counter read every ``--sample`` seconds sees a step's length to within that: the longest still
time is an upper bound on the longest step by one sample.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from trainer.core.scale.fit import bytes_per_s
from trainer.ctr.serving.bench import _wait

PAUSE_OVER_MEDIAN_S = 0.5      # a move's longest step at most this much over the median step before
DURING_OVER_BEFORE = 0.7       # samples/s while a move runs, against before it
RESTART_OVER_LIVE = 20.0       # the restart's time without training, against the live move's
LINK_SLACK, LINK_GRACE_S = 1.5, 5.0     # a move within 1.5× its bytes over the link rate, plus 5 s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=float, default=1.0, help="Criteo Kaggle's cardinalities times this "
                                                            "(1: 33.8 M rows)")
    p.add_argument("--servers", type=int, default=2, help="servers before the first move (one is added, then "
                                                          "taken away)")
    p.add_argument("--trainers", type=int, default=2, help="trainers")
    p.add_argument("--consistency", default="async", help="async, sync, hybrid or ssp:K")
    p.add_argument("--batch-size", type=int, default=2048, help="samples per trainer step")
    p.add_argument("--window", type=float, default=15.0, help="seconds of training measured before each move "
                                                              "and from its start")
    p.add_argument("--sample", type=float, default=0.05, help="seconds between reads of the trainers' counters")
    p.add_argument("--no-restart", action="store_true", help="leave out the stop-and-start side")
    p.add_argument("--compare-steps", type=int, metavar="N",
                   help="train N steps (the moves within them), then the same job again without moves, and compare "
                        "the two models bit for bit (sync, or one trainer; instead of the stop-and-start side)")
    p.add_argument("--count-updates", action="store_true",
                   help="count every row's updates and the trainers' acknowledged steps, and after the moves show "
                        "that none was lost or applied twice (async or ssp; any number of trainers)")
    p.add_argument("--keep", type=Path, help="keep the jobs' logs and the counters read in this folder")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the start, a move or the restart may take")
    p.add_argument("--emulate-hosts", action="store_true", help="every member on an emulated host of its own "
                                                                 "(rpcps up --emulate-hosts; needs root)")
    p.add_argument("--host-cpus", type=float, help="cores each emulated host may use (default: no quota)")
    p.add_argument("--link-rate", help="each emulated host's outgoing link, in tc's units (1gbit): the move's "
                                       "time is then judged against its bytes over this rate")
    p.add_argument("--json", action="store_true", help="JSON only (the output is JSON anyway)")


class Counters:
    """Every trainer's step counter (``/status`` ``step``) read every ``period`` seconds in a
    thread: (monotonic time, steps) per trainer."""

    def __init__(self, urls: dict[str, str], period: float) -> None:
        import httpx
        self.period = period
        self.seen: dict[str, list[tuple[float, int]]] = {n: [] for n in urls}
        self.marks: list[tuple[str, float]] = []        # what happened when, for ``--keep``
        self._clients = {n: httpx.Client(base_url=u, timeout=5.0) for n, u in urls.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="counters", daemon=True)

    def __enter__(self) -> "Counters":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for c in self._clients.values():
            c.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, c in self._clients.items():
                try:
                    step = int(c.get("/status").json().get("step") or 0)
                except Exception:  # noqa: BLE001 - busy for a moment: the next read counts
                    continue
                self.seen[name].append((time.monotonic(), step))
            self._stop.wait(self.period)

    def steps_between(self, start: float, end: float) -> int:
        """Steps every trainer took from ``start`` to ``end`` (monotonic), as far as read."""
        total = 0
        for seen in self.seen.values():
            inside = [s for t, s in seen if start <= t <= end]
            total += inside[-1] - inside[0] if len(inside) >= 2 else 0
        return total

    def median_step(self, start: float, end: float) -> Optional[float]:
        """The median of the trainers' mean step seconds over ``start``..``end``."""
        means = []
        for seen in self.seen.values():
            inside = [(t, s) for t, s in seen if start <= t <= end]
            if len(inside) >= 2 and inside[-1][1] > inside[0][1]:
                means.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
        return statistics.median(means) if means else None

    def stepped_after(self, when: float, timeout: float) -> None:
        """Wait until every trainer's counter moved after ``when`` (the end of a hold: its length
        is known only then)."""
        deadline = time.monotonic() + timeout
        while not all(any(t > when and s != prev for (t, s), (_, prev) in zip(seen[1:], seen[:-1]))
                      for seen in list(self.seen.values())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a trainer did not step within {timeout:.0f}s after the move")
            time.sleep(self.period)  # noqa: sleep-ok (polling the reads with a deadline)

    def longest_still(self, start: float, end: float) -> float:
        """The longest time any trainer's counter stood still from ``start`` to ``end``: from the
        read that first showed a step to the read that showed the next, the last step before
        ``start`` and the first after ``end`` included."""
        longest = 0.0
        for seen in self.seen.values():
            changed = [t for (t, s), (_, prev) in zip(seen[1:], seen[:-1]) if s != prev]
            marks = [t for t in changed if t < start][-1:] + [t for t in changed if start <= t <= end] \
                + [t for t in changed if t > end][:1]
            longest = max([longest, *(b - a for a, b in zip(marks, marks[1:]))])
        return longest


def _up_argv(ns: argparse.Namespace, tmp: Path, servers: int, resume: bool) -> list[str]:
    steps = ["--steps", str(ns.compare_steps)] if ns.compare_steps and not resume else []
    return [sys.executable, "-m", "supervise.cli", "up", "--workload", "ctr", "--scale", str(ns.scale),
            "--num-ps", str(servers), "--num-trainers", str(ns.trainers), "--consistency", ns.consistency,
            "--batch-size", str(ns.batch_size), "--eval-samples", "0", "--checkpoint-dir", str(tmp / "ck"),
            "--state-dir", str(tmp / "state"), "--progress-interval", "60", "--json",
            *(["--resume"] if resume else []), *steps, *(["--emulate-hosts"] if ns.emulate_hosts else []),
            *(["--count-updates"] if ns.count_updates else []),
            *(["--host-cpus", str(ns.host_cpus)] if ns.host_cpus is not None else []),
            *(["--link-rate", ns.link_rate] if ns.link_rate else [])]


class Up:
    """``rpcps up`` in a session of its own, its log in ``tmp``."""

    def __init__(self, argv: list[str], tmp: Path, name: str) -> None:
        self.tmp, self.log = tmp, tmp / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def sidecars(self) -> dict[str, str]:
        path = self.tmp / "state" / "cluster.json"
        try:
            return json.loads(path.read_text()).get("sidecars", {}) if path.exists() else {}
        except ValueError:
            return {}                                  # written as it is read: the next read
        # (cluster.json is replaced whole by rename, but a reader may still see an older one)

    def trainers(self) -> dict[str, str]:
        return {n: u for n, u in self.sidecars().items() if n.startswith("ctr")}

    def used(self) -> dict[str, dict[str, float]]:
        """What each member's emulated host has used so far: bytes sent on its link (``tx``) and
        CPU seconds (``cpu_s``); none on local processes."""
        from supervise.hosts.emulated import usage_of
        try:
            hosts = json.loads((self.tmp / "state" / "cluster.json").read_text()).get("hosts") or {}
        except (OSError, ValueError):
            return {}
        out = {}
        for name, described in hosts.items():
            try:
                usage = usage_of(described)
                out[name] = {"tx": float(usage["tx"]), "cpu_s": float(usage["cpu_s"])}
            except (OSError, subprocess.CalledProcessError, ValueError, KeyError):
                continue            # its host is going away: not counted
        return out

    def stop(self, timeout: float) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(30)


def _get(url: str, path: str) -> Any:
    import httpx
    try:
        r = httpx.get(f"{url}{path}", timeout=5.0)
        return r.json() if path != "/metrics" else r.text
    except Exception:  # noqa: BLE001 - starting or busy: not yet
        return None


def _steps_done(url: str) -> int:
    """This trainer process's steps (its counter starts at 0 with the process, unlike ``step``)."""
    text = _get(url, "/metrics") or ""
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("rpcps_trainer_steps_total{")))


def _scaled(ns: argparse.Namespace, up: Up, servers: int) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """``rpcps scale --servers servers`` run to its end; and each host's usage as last read
    meanwhile (a host is read every half second: a server let go takes its host with it)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "supervise.cli", "scale", "--servers", str(servers),
                                 "--state-dir", str(up.tmp / "state")], stdout=out, stderr=err, text=True)
        deadline, used = time.monotonic() + ns.timeout, up.used()
        while proc.poll() is None and time.monotonic() < deadline:
            used.update(up.used())
            time.sleep(0.5)  # noqa: sleep-ok (reading the hosts while the move runs, to a deadline)
        if proc.poll() is None:
            proc.kill()
        used.update(up.used())
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.wait(30), out.read(), err.read()), used


def _move(ns: argparse.Namespace, up: Up, counters: Counters, servers: int) -> dict[str, Any]:
    """``rpcps scale --servers servers`` as a user runs it, measured."""
    time.sleep(ns.window)  # noqa: sleep-ok (the window measured before the move)
    used_before = up.used()
    asked = time.monotonic()
    done, last_used = _scaled(ns, up, servers)
    ended = time.monotonic()
    used = {n: {k: v - used_before.get(n, {}).get(k, 0.0) for k, v in u.items()} for n, u in last_used.items()}
    counters.marks += [(f"asked {servers}", asked), (f"done {servers}", ended)]
    if done.returncode != 0:
        raise RuntimeError(f"rpcps scale --servers {servers} failed: {done.stderr[-2000:]}")
    change = json.loads(done.stdout.strip().splitlines()[-1])["ps0"]
    if change.get("state") != "done":
        raise RuntimeError(f"the change onto {servers} servers did not end done: {change}")
    # The move proper starts when every server it needs serves: the leader's ``seconds`` end at
    # ``ended`` (``rpcps scale`` returns as it ends); before that a new server was starting.
    moving = ended - float(change["seconds"])
    time.sleep(max(0.0, moving + ns.window - time.monotonic()) + ns.sample * 2)  # noqa: sleep-ok (the window from it)
    counters.stepped_after(ended, ns.timeout)
    median = counters.median_step(asked - ns.window, asked)
    longest = counters.longest_still(moving, ended)
    before = counters.steps_between(asked - ns.window, asked)
    asking = counters.steps_between(asked, asked + ns.window)        # with the new server's start
    during = counters.steps_between(moving, moving + ns.window)
    return {"servers": servers, "epoch": change["epoch"], "moved_slots": change["moved_slots"],
            "moved_units": len(change["moved_units"]), "bytes": change["bytes"],
            "bytes_ahead": change.get("ahead_bytes", 0), "copying_ahead_s": change.get("ahead_seconds", 0.0),
            "trainers_held_s": change["pause_seconds"], "taking_s": change["take_seconds"],
            "rebuilding_s": change["rebuild_seconds"], "move_s": change["seconds"],
            "asked_to_done_s": round(ended - asked, 3), "link": links(used, ended - asked, ns.link_rate,
                                                                      change.get("ahead_bytes", 0) + change["bytes"]),
            "median_step_s": round(median, 4) if median else None,
            "longest_step_s": round(longest, 3), "samples_per_s": {
                "before": round(before * ns.batch_size / ns.window, 1),
                "during": round(during * ns.batch_size / ns.window, 1),
                "from_asked": round(asking * ns.batch_size / ns.window, 1)}}


def links(used: dict[str, dict[str, float]], seconds: float, rate: Optional[str],
          moved: int) -> Optional[dict[str, Any]]:
    """What the hosts used in the ``seconds`` from a move's request to its end (``used``: each
    host's bytes sent and CPU seconds, training's included; None: local processes): the busiest
    link's mean rate and the cores all used, the proof of which bounded the move; and, with a
    capped ``rate``, the time its ``moved`` bytes take over one such link: the least a move
    through one link can take."""
    if not used:
        return None
    sent = {n: int(u.get("tx", 0)) for n, u in used.items()}
    busiest = max(sent, key=sent.get)
    over_link = moved / bytes_per_s(rate) if rate else None
    return {"rate": rate, "sent_bytes": sent, "busiest": busiest,
            "busiest_mean_bytes_per_s": round(sent[busiest] / max(seconds, 1e-3)),
            "cpu_s": {n: round(u.get("cpu_s", 0.0), 2) for n, u in used.items()},
            "cores_used": round(sum(u.get("cpu_s", 0.0) for u in used.values()) / max(seconds, 1e-3), 2),
            "moved_over_link_s": round(over_link, 3) if over_link is not None else None}


def within_link(move: dict[str, Any]) -> Optional[bool]:
    """Whether a move took at most 1.5 times its bytes over the link rate, plus 5 s (None: no
    capped link to judge it by)."""
    link = move.get("link") or {}
    if link.get("moved_over_link_s") is None:
        return None
    return move["move_s"] <= LINK_SLACK * link["moved_over_link_s"] + LINK_GRACE_S


def _restart(ns: argparse.Namespace, up: Up, tmp: Path, servers: int) -> dict[str, Any]:
    """The way without live moves: SIGTERM (the final checkpoint), then ``rpcps up --num-ps
    servers --resume``, timed to each trainer's first step."""
    stopped = time.monotonic()
    code = up.stop(ns.timeout)
    exited = time.monotonic()
    if code != 0:
        raise RuntimeError(f"rpcps up exited {code} on SIGTERM: {up.log.read_text()[-2000:]}")
    again = Up(_up_argv(ns, tmp, servers, resume=True), tmp, "restart")
    try:
        first: dict[str, float] = {}

        def stepped() -> bool:
            for name, url in again.trainers().items():
                if name not in first and _steps_done(url) >= 1:
                    first[name] = time.monotonic()
            return len(first) == ns.trainers
        _wait(stepped, ns.timeout, lambda: again.proc.poll() is None, again.log)
    finally:
        again.stop(120)
    return {"servers": servers, "stop_s": round(exited - stopped, 3),
            "start_to_first_step_s": round(min(first.values()) - exited, 3),
            "without_training_s": round(min(first.values()) - stopped, 3),
            "until_every_trainer_s": round(max(first.values()) - stopped, 3)}


def _compare(ns: argparse.Namespace, up: Up, counters: Counters, tmp: Path) -> dict[str, Any]:
    """The moved job run on to its ``--compare-steps`` (its final checkpoint), and the same job
    again on its first servers without a move, started beside it once the moves are measured (a
    sync job's result does not depend on its speed); both exported as a user does (``rpcps
    export``: every table whole, by id) and compared tensor by tensor."""
    last = max((seen[-1][1] for seen in counters.seen.values() if seen), default=0)
    if last >= ns.compare_steps:
        raise RuntimeError(f"the trainers were at step {last} once the moves were measured, past the last "
                           f"({ns.compare_steps}): give --compare-steps more")
    still_tmp = tmp / "still"
    still_tmp.mkdir()
    runs = [(up, tmp), (Up(_up_argv(ns, still_tmp, ns.servers, resume=False), still_tmp, "still"), still_tmp)]
    try:
        models = []
        for job, where in runs:
            code = job.proc.wait(ns.timeout)
            if code != 0:
                raise RuntimeError(f"rpcps up exited {code}: {job.log.read_text()[-2000:]}")
            models.append(_exported(where))
    finally:
        for job, _ in runs:         # the job without moves too, whatever failed
            job.stop(120)
    return same_model(*models, steps=ns.compare_steps)


def _exported(tmp: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "export", "--checkpoint", str(tmp / "ck"), "--out",
                           str(tmp / "export")], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"rpcps export failed: {done.stderr[-2000:]}")
    import torch
    return torch.load(tmp / "export" / "weights.pt", weights_only=True)


def same_model(moved: dict[str, Any], unmoved: dict[str, Any], steps: int) -> dict[str, Any]:
    """Two exported models (``weights.pt``) compared: every table and dense tensor, bit for bit."""
    import torch

    def leaves(tree: Any, at: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{at}/{key}" if at else str(key)).items()}
        return {at: tree}
    a, b = leaves(moved), leaves(unmoved)
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    differ = sorted({*a.keys() ^ b.keys(), *(k for k in a.keys() & b.keys() if not (
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) and isinstance(b[k], torch.Tensor) else a[k] == b[k]))})
    return {"steps": steps, "tensors": len(tensors), "values": sum(a[k].numel() for k in tensors),
            "differing": len(differ), "first_differing": differ[:5], "bit_identical": not differ and bool(tensors)}


def _keep(folder: Path, tmp: Path, counters: Counters, moves: list[dict[str, Any]]) -> None:
    """The jobs' logs and every counter read (seconds since the first read), for a look after."""
    import shutil
    folder.mkdir(parents=True, exist_ok=True)
    for log in [*tmp.glob("*.log"), *(tmp / "state").rglob("*.log"), *(tmp / "still").glob("*.log")]:
        shutil.copy(log, folder / log.name)
    first = min((seen[0][0] for seen in counters.seen.values() if seen), default=0.0)
    (folder / "counters.json").write_text(json.dumps(
        {"moves": moves, "marks": [(what, round(t - first, 3)) for what, t in counters.marks], "seen": {n: [(round(t - first, 3), s) for t, s in seen] for n, seen in counters.seen.items()}}))


def _counted(up: Up, timeout: float) -> dict[str, Any]:
    """Every trainer stopped, then the counts of every server and trainer added up (``job_tally``)."""
    from ps.spec.counting import job_tally
    from services.client import SidecarClient, SidecarError
    trainers = up.trainers()
    for url in trainers.values():
        with SidecarClient(url, timeout=30.0) as c:
            try:
                c.stop_episode()
            except SidecarError as exc:
                if exc.status != 409:       # 409: its episode had ended already
                    raise
    _wait(lambda: all((_get(u, "/status") or {}).get("state") == "idle" for u in trainers.values()), timeout,
          lambda: up.proc.poll() is None, up.log)
    servers = [u for n, u in up.sidecars().items() if n.startswith("ps")]
    return job_tally([_get(u, "/counts") for u in servers], [_get(u, "/counts") for u in trainers.values()])


def _refused(ns: argparse.Namespace) -> Optional[str]:
    """Why these settings cannot run, before anything starts (None: they can)."""
    if not ns.emulate_hosts and (ns.host_cpus is not None or ns.link_rate):
        return "--host-cpus and --link-rate are settings of --emulate-hosts"
    if ns.count_updates:
        from ps.spec.counting import check_mode
        try:
            check_mode(ns.consistency)
        except ValueError as exc:
            return str(exc)
    if ns.compare_steps is not None:
        if ns.compare_steps < 1:
            return "--compare-steps: at least 1"
        if ns.consistency != "sync" and ns.trainers != 1:
            return (f"--compare-steps: {ns.trainers} {ns.consistency} trainers' updates come in no fixed order, so "
                    "two runs differ moved or not: compare a sync job, or one trainer's")
    return None


def run(ns: argparse.Namespace) -> int:
    n = ns.servers
    refused = _refused(ns)
    if refused:
        print(f"rpcps bench reshard: {refused}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rpcps-bench-reshard-") as tmp_name:
        tmp = Path(tmp_name)
        up = Up(_up_argv(ns, tmp, n, resume=False), tmp, "up")
        try:
            _wait(lambda: len(up.trainers()) == ns.trainers
                  and all((_get(u, "/status") or {}).get("step", 0) >= 3 for u in up.trainers().values()),
                  ns.timeout, lambda: up.proc.poll() is None, up.log)
            with Counters(up.trainers(), ns.sample) as counters:
                moves = [_move(ns, up, counters, n + 1), _move(ns, up, counters, n)]
            compared = _compare(ns, up, counters, tmp) if ns.compare_steps else None
            counted = _counted(up, ns.timeout) if ns.count_updates else None
            restart = None if ns.no_restart or compared else _restart(ns, up, tmp, n + 1)
        finally:
            up.stop(120)
        checkpoint_bytes = sum(f.stat().st_size for f in (tmp / "ck").rglob("*.pt")) if (tmp / "ck").exists() else 0
        if ns.keep is not None:
            _keep(ns.keep, tmp, counters, moves)
    # Without training: what the longest step took past the median step (the hold is inside it).
    live = max(max(0.0, m["longest_step_s"] - (m["median_step_s"] or 0.0)) for m in moves)
    met = {"step_within_0.5s_of_median": all(m["median_step_s"] is not None and m["longest_step_s"]
                                             <= m["median_step_s"] + PAUSE_OVER_MEDIAN_S for m in moves),
           "samples_during_at_least_0.7x": all(m["samples_per_s"]["during"]
                                               >= DURING_OVER_BEFORE * m["samples_per_s"]["before"] for m in moves)}
    if ns.link_rate:
        met["move_within_1.5x_bytes_over_link_plus_5s"] = all(within_link(m) for m in moves)
    if compared is not None:
        met["bit_identical_to_the_job_without_moves"] = compared["bit_identical"]
    if counted is not None:
        met["no_acknowledged_update_lost"] = counted["lost"] == 0 and counted["acknowledged"] > 0
        met["no_update_applied_twice"] = counted["twice"] == 0
    if restart is not None:
        met["without_training_20x_shorter"] = restart["without_training_s"] >= RESTART_OVER_LIVE * max(live, 1e-3)
    print(json.dumps({
        "bench": "reshard", "moves": moves, "restart": restart, "compared": compared, "counted": counted,
        "without_training_s": {"live": round(live, 3),
                               "restart": restart["without_training_s"] if restart else None},
        "met": met,
        "limits": {"load_avg": os.getloadavg(), "cpus": os.cpu_count(), "sample_s": ns.sample,
                   "checkpoint_bytes": checkpoint_bytes,
                   "bytes_per_held_s": [round(m["bytes"] / max(m["trainers_held_s"], 1e-3)) for m in moves]},
        "config": {"scale": ns.scale, "servers": n, "trainers": ns.trainers, "consistency": ns.consistency,
                   "batch_size": ns.batch_size, "window_s": ns.window, "emulate_hosts": ns.emulate_hosts,
                   "host_cpus": ns.host_cpus, "link_rate": ns.link_rate, "compare_steps": ns.compare_steps,
                   "count_updates": ns.count_updates}}),
          flush=True)
    return 0
