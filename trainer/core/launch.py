"""`rpcps up` for a workload of parameter servers and trainers: what to start, how its progress
reads, when it is done. A workload's launch is this with its own flags, its trainers' role and
what its evaluation says (``held_out``, ``held_out_line``). ps0 leads."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from ps.spec.config import ps_names
from services.names import format_name
from services.progress import ProgressStatus, combine, describe
from supervise.upconfig import LauncherConfig, flags
from services.workload import Planned
from trainer.core.config import TrainersUpSettings

LEADER = "ps0"
SERVER_FLAGS = ("seed", "checkpoint_every_steps", "checkpoint_every_seconds", "full_checkpoint_every", "consistency",
                "count_updates")
TRAINER_FLAGS = ("seed", "clip", "warmup_steps")


class TrainersLaunch:
    workload: ClassVar[str]
    trainer: ClassVar[str]                        # the trainers' role
    unit: ClassVar[str]                           # what their throughput counts
    server_flags: ClassVar[tuple[str, ...]] = ()  # the workload's settings its servers take, besides SERVER_FLAGS
    trainer_flags: ClassVar[tuple[str, ...]] = ()

    def __init__(self, common: LauncherConfig, settings: TrainersUpSettings) -> None:
        self.common, self.cfg = common, settings

    def server_argv(self) -> list[str]:
        """What every server is told besides the shared flags (the LM: its vocabulary's size)."""
        return []

    def server(self, name: str, count: int) -> Planned:
        """Server ``name`` of a job on ``count`` servers."""
        return Planned(name, "ps", ["--workload", self.workload, "--num-ps", str(count), *self.server_argv(),
                                    *self.common.restoring_flags(),
                                    *flags(self.cfg, (*SERVER_FLAGS, *self.server_flags))])

    def members(self, leader: dict[str, Any]) -> Optional[list[Planned]]:
        """The servers the leader's status wants: those a change of layout it was asked for waits
        on, else those of its layout (None before it says)."""
        names = leader.get("wanted") or list((leader.get("layout") or {}).get("servers", {}))
        return [self.server(n, len(names)) for n in names] if names else None

    def plan(self) -> list[Planned]:
        cfg = self.cfg
        servers = [self.server(name, cfg.num_ps) for name in ps_names(cfg.num_ps)]
        trainers = []
        for i in range(cfg.num_trainers):
            argv = ["--num-ps", str(cfg.num_ps), "--num-trainers", str(cfg.num_trainers), "--start",
                    "--dense", cfg.dense_at, *flags(cfg, (*TRAINER_FLAGS, *self.trainer_flags))]
            if cfg.steps:
                argv += ["--steps", str(cfg.steps)]
            if i == 0 and cfg.straggler > 1.0:
                argv += ["--slow-down", str(cfg.straggler)]
            elif cfg.jitter > 1.0:
                argv += ["--slow-down", str(cfg.jitter), "--slow-fraction", str(cfg.jitter_fraction)]
            trainers.append(Planned(format_name(self.trainer, i), self.trainer, argv))
        return servers + trainers

    def watched(self, names: list[str]) -> list[str]:
        return [n for n in names if n.startswith(self.trainer)]

    def stop_waves(self, names: list[str]) -> list[list[str]]:
        """Trainers first, then the other servers, ps0 (the store host) last."""
        return [self.watched(names), [n for n in names if n.startswith("ps") and n != LEADER], [LEADER]]

    def finished(self, statuses: dict[str, Any]) -> bool:
        if not self.cfg.steps:
            return False
        return bool(statuses) and all(
            s.episode is not None and s.episode.done and s.episode.steps == self.cfg.steps and not s.evaluating
            for s in statuses.values())

    def rate(self, status: Any) -> float:
        return getattr(status, f"{self.unit}_per_s") or 0.0

    def progress(self, statuses: dict[str, Any]) -> list[dict]:
        st = list(statuses.values())
        losses = [s.loss_avg for s in st if s.loss_avg is not None]
        steps = [s.episode.step if s.episode else 0 for s in st]
        # The trainers training now; once all have finished, the rates their episodes ended at.
        rating = [s for s in st if s.state == "running"] or st
        evaluating = [n for n, s in statuses.items() if s.evaluating]
        # Training's progress, or, once any trainer evaluates, the evaluation's (its own ETA).
        phase = "evaluate" if evaluating else "train"
        shown = [s.progress for s in st] if evaluating else [_training(s) for s in st]
        return [{"event": "progress", "step": min(steps) if steps else 0, "steps": self.cfg.steps,
                 "loss": sum(losses) / len(losses) if losses else None,
                 f"{self.unit}_per_s": sum(self.rate(s) for s in rating),
                 "trainers": {n: s.episode.step if s.episode else 0 for n, s in statuses.items()},
                 "evaluating": evaluating, "phase": phase,
                 "waiting_for": sorted({n for s in st for n in s.waiting_for}), **combine(shown, phase)}]

    def held_out(self, statuses: list[Any]) -> dict[str, Any]:
        """The `done` event's fields from the trainers' evaluations."""
        return {}

    def held_out_line(self, event: dict[str, Any]) -> str:
        """The `done` line's words on the evaluation ("" for none)."""
        return ""

    def summary(self, statuses: dict[str, Any], restarts: int) -> dict:
        st = list(statuses.values())
        firsts = [s.loss_first for s in st if s.loss_first is not None]
        lasts = [s.loss_avg for s in st if s.loss_avg is not None]
        return {"event": "done",
                "steps": min((s.episode.step if s.episode else 0) for s in st) if st else 0,
                "total_steps": sum(s.step for s in st),
                "loss_first": sum(firsts) / len(firsts) if firsts else None,
                "loss_last": sum(lasts) / len(lasts) if lasts else None,
                f"{self.unit}_per_s": self._per_s(st), **self.held_out(st),
                "restarts": restarts, "bytes_per_step": _bytes_per_step(st), "per_step": _per_step(st)}

    def human(self, e: dict[str, Any]) -> Optional[str]:
        unit = self.unit
        if e["event"] == "progress" and e.get("phase") == "evaluate":
            return f"evaluating the held-out split | {describe(e)}"
        if e["event"] == "progress":
            per = " ".join(f"{n} {s}" for n, s in e["trainers"].items())
            loss = "-" if e["loss"] is None else f"{e['loss']:.3f}"
            waiting = f"waiting for {', '.join(e['waiting_for'])}" if e.get("waiting_for") else ""
            return " | ".join(p for p in (f"step {e['step']}{'/' + str(e['steps']) if e.get('steps') else ''}",
                                          describe(e), f"loss {loss}", _rate(e, unit), per,
                                          waiting) if p)
        if e["event"] == "done":
            first = "-" if e["loss_first"] is None else f"{e['loss_first']:.3f}"
            last = "-" if e["loss_last"] is None else f"{e['loss_last']:.3f}"
            where = " (one process)" if e.get("local") else ""
            return (f"done{where}: {e['steps']} steps | loss {first} -> {last} | {_rate(e, unit)}"
                    f"{self.held_out_line(e)}")
        return None

    def _per_s(self, statuses: list[Any]) -> float:
        windows = [s.timed for s in statuses if s.timed and getattr(s.timed, self.unit)]
        if windows and len(windows) == len(statuses):
            # Everything timed over the union of the trainers' timed windows: summing per-trainer
            # rates would count the stretches where one trainer ran alone as if both did.
            span = max(w.end for w in windows) - min(w.start for w in windows)
            return sum(getattr(w, self.unit) for w in windows) / span if span > 0 else 0.0
        return sum(self.rate(s) for s in statuses)


def _rate(e: dict[str, Any], unit: str) -> str:
    rate = e.get(f"{unit}_per_s")
    return f"- {unit}/s (no step past the warm-up)" if rate is None else f"{rate:.0f} {unit}/s"


def _training(s: Any) -> Optional[ProgressStatus]:
    """A trainer's training progress, also once it has gone on to evaluate (its episode's steps)."""
    if s.progress is not None and s.progress.phase == "train":
        return s.progress
    ep = s.episode
    return None if ep is None else ProgressStatus(phase="train", done=ep.step, total=ep.steps,
                                                  eta_s=0.0 if ep.done else None)


def _bytes_per_step(statuses: list[Any]) -> dict[str, float]:
    """What a trainer's step moves, on average over every trainer's steps."""
    steps = sum(s.moved.steps for s in statuses)
    return {key: sum(getattr(s.moved, field) for s in statuses) / steps if steps else 0.0
            for key, field in (("rpc", "rpc_bytes"), ("allreduce", "allreduce_bytes"), ("saved", "bytes_saved"))}


def _per_step(statuses: list[Any]) -> dict[str, Any]:
    """Where a trainer's step goes, on average over every trainer's steps: its messages to the
    servers, the seconds of each phase and its training thread's CPU seconds in each (of the steps
    past the warm-up), and with a rows cache the share of ids it gave."""
    steps = sum(s.moved.steps for s in statuses)
    timed = sum(s.moved.timed_steps for s in statuses)
    phases = sorted({p for s in statuses for p in s.moved.phase_seconds})
    cpu_phases = sorted({p for s in statuses for p in s.moved.phase_cpu_seconds})
    found = {"rpcs": sum(s.moved.rpcs for s in statuses) / steps if steps else 0.0,
             "seconds": {p: sum(s.moved.phase_seconds.get(p, 0.0) for s in statuses) / timed for p in phases}
             if timed else {},
             "cpu_seconds": {p: sum(s.moved.phase_cpu_seconds.get(p, 0.0) for s in statuses) / timed
                             for p in cpu_phases} if timed else {}}
    caches = [s.cache for s in statuses if s.cache is not None]
    asked = sum(c.hits + c.misses for c in caches)
    if asked:           # --cache-rows: of a step's distinct ids, the share taken from the trainer's copies
        found["cache_hit_rate"] = sum(c.hits for c in caches) / asked
    named = sum(c.lookups for c in caches)
    if named:           # the same of every id its batch named, repeats counted
        found["cache_lookup_hit_rate"] = sum(c.lookup_hit_rate * c.lookups for c in caches) / named
    return found
