"""`rpcps up --workload lm`: parameter servers and language-model trainers as local processes, and
how their progress reads. ps0 leads."""
from __future__ import annotations

import math
from typing import Any, Optional

from ps.config import ps_names
from services.upconfig import LauncherConfig, flags
from services.names import format_name
from services.progress import ProgressStatus, combine, describe
from services.workload import Planned
from trainer.lm.config import LmUpSettings
from trainer.lm.status import TrainerStatus

LEADER = "ps0"
_PS_FLAGS = ("emsize", "nhid", "nlayers", "optimizer", "lr", "seed", "checkpoint_every_steps", "checkpoint_every_seconds",
             "consistency")
_TRAINER_FLAGS = ("batch_size", "bptt", "dropout", "clip", "eval_tokens", "synthetic_tokens", "seed", "data",
                  "warmup_steps", "dense")


class LmLaunch:
    def __init__(self, common: LauncherConfig, settings: LmUpSettings) -> None:
        self.common, self.cfg = common, settings

    def plan(self) -> list[Planned]:
        cfg = self.cfg
        ntoken = cfg.ntoken
        if ntoken is None:
            from trainer.lm.data import vocab_size
            ntoken = vocab_size(cfg.data)
        servers = [Planned(name, "ps", ["--workload", "lm", "--num-ps", str(cfg.num_ps), "--ntoken", str(ntoken),
                                        *self.common.restoring_flags(), *flags(cfg, _PS_FLAGS)])
                   for name in ps_names(cfg.num_ps)]
        trainers = []
        for i in range(cfg.num_trainers):
            argv = ["--num-ps", str(cfg.num_ps), "--num-trainers", str(cfg.num_trainers), "--start",
                    *flags(cfg, _TRAINER_FLAGS)]
            if cfg.steps:
                argv += ["--steps", str(cfg.steps)]
            if i == 0 and cfg.straggler > 1.0:
                argv += ["--slow-down", str(cfg.straggler)]
            elif cfg.jitter > 1.0:
                argv += ["--slow-down", str(cfg.jitter), "--slow-fraction", str(cfg.jitter_fraction)]
            trainers.append(Planned(format_name("trainer", i), "trainer", argv))
        return servers + trainers

    def watched(self, names: list[str]) -> list[str]:
        return [n for n in names if n.startswith("trainer")]

    def stop_waves(self, names: list[str]) -> list[list[str]]:
        """Trainers first, then the other servers, ps0 (the store host) last."""
        return [self.watched(names), [n for n in names if n.startswith("ps") and n != LEADER], [LEADER]]

    def finished(self, statuses: dict[str, TrainerStatus]) -> bool:
        if not self.cfg.steps:
            return False
        return bool(statuses) and all(
            s.episode is not None and s.episode.done and s.episode.steps == self.cfg.steps and not s.evaluating
            for s in statuses.values())

    def progress(self, statuses: dict[str, TrainerStatus]) -> list[dict]:
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
                 "tokens_per_s": sum(s.tokens_per_s or 0.0 for s in rating),
                 "trainers": {n: s.episode.step if s.episode else 0 for n, s in statuses.items()},
                 "evaluating": evaluating, "phase": phase, **combine(shown, phase)}]

    def summary(self, statuses: dict[str, TrainerStatus], restarts: int) -> dict:
        st = list(statuses.values())
        firsts = [s.loss_first for s in st if s.loss_first is not None]
        lasts = [s.loss_avg for s in st if s.loss_avg is not None]
        evals = [s.eval for s in st if s.eval]
        val_tokens = sum(e.tokens for e in evals)
        val_loss = sum(e.loss_sum for e in evals) / val_tokens if val_tokens else None
        return {"event": "done",
                "steps": min((s.episode.step if s.episode else 0) for s in st) if st else 0,
                "total_steps": sum(s.step for s in st),
                "loss_first": sum(firsts) / len(firsts) if firsts else None,
                "loss_last": sum(lasts) / len(lasts) if lasts else None,
                "tokens_per_s": _tokens_per_s(st),
                "val_loss": val_loss, "val_ppl": math.exp(val_loss) if val_loss is not None else None,
                "val_tokens": val_tokens, "restarts": restarts, "bytes_per_step": _bytes_per_step(st)}

    def human(self, e: dict[str, Any]) -> Optional[str]:
        if e["event"] == "progress" and e.get("phase") == "evaluate":
            return f"evaluating the held-out split | {describe(e)}"
        if e["event"] == "progress":
            per = " ".join(f"{n} {s}" for n, s in e["trainers"].items())
            loss = "-" if e["loss"] is None else f"{e['loss']:.3f}"
            return " | ".join(p for p in (f"step {e['step']}{'/' + str(e['steps']) if e.get('steps') else ''}",
                                          describe(e), f"loss {loss}", f"{e['tokens_per_s']:.0f} tokens/s", per) if p)
        if e["event"] == "done":
            val = f" | held-out ppl {e['val_ppl']:.1f}" if e.get("val_ppl") is not None else ""
            first = "-" if e["loss_first"] is None else f"{e['loss_first']:.3f}"
            last = "-" if e["loss_last"] is None else f"{e['loss_last']:.3f}"
            return f"done: {e['steps']} steps | loss {first} -> {last} | {e['tokens_per_s']:.0f} tokens/s{val}"
        return None


def _training(s: TrainerStatus) -> Optional[ProgressStatus]:
    """A trainer's training progress, also once it has gone on to evaluate (its episode's steps)."""
    if s.progress is not None and s.progress.phase == "train":
        return s.progress
    ep = s.episode
    return None if ep is None else ProgressStatus(phase="train", done=ep.step, total=ep.steps,
                                                  eta_s=0.0 if ep.done else None)


def _tokens_per_s(statuses: list[TrainerStatus]) -> float:
    windows = [s.timed for s in statuses if s.timed and s.timed.tokens]
    if windows and len(windows) == len(statuses):
        # Total tokens over the union of the trainers' timed windows: summing per-trainer rates
        # would count the stretches where one trainer ran alone as if both did.
        span = max(w.end for w in windows) - min(w.start for w in windows)
        return sum(w.tokens for w in windows) / span if span > 0 else 0.0
    return sum(s.tokens_per_s or 0.0 for s in statuses)


def _bytes_per_step(statuses: list[TrainerStatus]) -> dict[str, float]:
    """What a trainer's step moves, on average over every trainer's steps."""
    steps = sum(s.moved.steps for s in statuses)
    return {"rpc": sum(s.moved.rpc_bytes for s in statuses) / steps if steps else 0.0,
            "allreduce": sum(s.moved.allreduce_bytes for s in statuses) / steps if steps else 0.0}
