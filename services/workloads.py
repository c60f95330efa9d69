"""What ``rpcps up`` starts for each workload, how it reads their progress, and when it is done.

The launcher (``services/launcher.py``) is the same for both: it spawns, supervises, restarts and
stops what a workload plans here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from services.config import UpConfig
from services.names import format_name

_PS_FLAGS = ("emsize", "nhid", "nlayers", "optimizer", "lr", "seed", "resume_from", "keep_checkpoints",
             "checkpoint_every_steps", "checkpoint_every_seconds")
_TRAINER_FLAGS = ("batch_size", "bptt", "dropout", "clip", "eval_tokens", "synthetic_tokens", "seed", "data",
                  "warmup_steps")
_AGENT_FLAGS = ("env", "seed", "resume_from", "keep_checkpoints", "episodes", "max_steps")
_OBSERVER_FLAGS = ("env", "seed")
_COMMON_FLAGS = ("threads", "log_level", "sidecar_host", "rpc_transport")


@dataclass(frozen=True)
class Planned:
    name: str
    role: str            # the `rpcps <role>` subcommand
    argv: list[str]      # its flags, besides name, ports and rendezvous


class LmWorkload:
    """Parameter servers and language-model trainers; ps0 leads."""

    leader = "ps0"
    checkpoint_dir = Path("checkpoints")

    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg

    def plan(self) -> list[Planned]:
        cfg = self.cfg
        ntoken = cfg.ntoken
        if ntoken is None:
            from trainer.lm.data import vocab_size
            ntoken = vocab_size(cfg.data)
        out = []
        for i in range(cfg.ps):
            out.append(Planned(format_name("ps", i), "ps", ["--num-ps", str(cfg.ps), "--ntoken", str(ntoken),
                                                             "--resume" if cfg.resume else "--no-resume",
                                                             *flags(cfg, _PS_FLAGS)]))
        for i in range(cfg.trainers):
            argv = ["--num-ps", str(cfg.ps), "--num-trainers", str(cfg.trainers), "--start", *flags(cfg, _TRAINER_FLAGS)]
            if cfg.steps:
                argv += ["--steps", str(cfg.steps)]
            out.append(Planned(format_name("trainer", i), "trainer", argv))
        return out

    def restartable(self, name: str) -> bool:
        return name != self.leader        # ps0 hosts the store: everyone would have to rejoin

    def watched(self, names: list[str]) -> list[str]:
        return [n for n in names if n.startswith("trainer")]

    def stop_waves(self, names: list[str]) -> list[list[str]]:
        """Trainers first, then the other servers, ps0 (the store host) last."""
        return [self.watched(names), [n for n in names if n.startswith("ps") and n != self.leader], [self.leader]]

    def finished(self, statuses: dict[str, dict]) -> bool:
        if not self.cfg.steps:
            return False
        for s in statuses.values():
            ep = s.get("episode") or {}
            if not (ep.get("done") and ep.get("steps") == self.cfg.steps and not s.get("evaluating")):
                return False
        return bool(statuses)

    def progress(self, statuses: dict[str, dict]) -> list[dict]:
        st = list(statuses.values())
        losses = [s["loss_avg"] for s in st if s.get("loss_avg") is not None]
        steps = [((s.get("episode") or {}).get("step") or 0) for s in st]
        return [{"event": "progress", "step": min(steps) if steps else 0, "steps": self.cfg.steps,
                 "loss": sum(losses) / len(losses) if losses else None,
                 # The trainers training now; once all have finished, the rates their episodes ended at.
                 "tokens_per_s": sum(s.get("tokens_per_s") or 0.0
                                     for s in ([s for s in st if s.get("state") == "running"] or st)),
                 "trainers": {n: (s.get("episode") or {}).get("step", 0) for n, s in statuses.items()},
                 "evaluating": [n for n, s in statuses.items() if s.get("evaluating")]}]

    def summary(self, statuses: dict[str, dict], restarts: int) -> dict:
        st = list(statuses.values())
        firsts = [s["loss_first"] for s in st if s.get("loss_first") is not None]
        lasts = [s["loss_avg"] for s in st if s.get("loss_avg") is not None]
        evals = [s["eval"] for s in st if s.get("eval")]
        val_tokens = sum(e["tokens"] for e in evals)
        val_loss = sum(e["loss_sum"] for e in evals) / val_tokens if val_tokens else None
        windows = [s["timed"] for s in st if (s.get("timed") or {}).get("tokens")]
        if windows and len(windows) == len(st):
            # Total tokens over the union of the trainers' timed windows: summing per-trainer rates
            # would count the stretches where one trainer ran alone as if both did.
            span = max(w["end"] for w in windows) - min(w["start"] for w in windows)
            tokens_per_s = sum(w["tokens"] for w in windows) / span if span > 0 else 0.0
        else:
            tokens_per_s = sum(s.get("tokens_per_s") or 0.0 for s in st)
        return {"event": "done",
                "steps": min(((s.get("episode") or {}).get("step") or 0) for s in st) if st else 0,
                "total_steps": sum(s.get("step") or 0 for s in st),
                "loss_first": sum(firsts) / len(firsts) if firsts else None,
                "loss_last": sum(lasts) / len(lasts) if lasts else None,
                "tokens_per_s": tokens_per_s,
                "val_loss": val_loss, "val_ppl": math.exp(val_loss) if val_loss is not None else None,
                "val_tokens": val_tokens, "restarts": restarts}

    @staticmethod
    def human(e: dict) -> Optional[str]:
        if e["event"] == "progress":
            per = " ".join(f"{n} {s}" for n, s in e["trainers"].items())
            loss = "-" if e["loss"] is None else f"{e['loss']:.3f}"
            evaluating = " | evaluating the held-out split" if e.get("evaluating") else ""
            return (f"step {e['step']}{'/' + str(e['steps']) if e.get('steps') else ''} | loss {loss} | "
                    f"{e['tokens_per_s']:.0f} tokens/s | {per}{evaluating}")
        if e["event"] == "done":
            val = f" | held-out ppl {e['val_ppl']:.1f}" if e.get("val_ppl") is not None else ""
            first = "-" if e["loss_first"] is None else f"{e['loss_first']:.3f}"
            last = "-" if e["loss_last"] is None else f"{e['loss_last']:.3f}"
            return f"done: {e['steps']} steps | loss {first} -> {last} | {e['tokens_per_s']:.0f} tokens/s{val}"
        return None


class RlWorkload:
    """The agent and its observers; the agent leads."""

    leader = "agent"
    checkpoint_dir = Path("checkpoints/rl")

    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg
        self._reported = 0       # the last episode a progress event was emitted for

    def plan(self) -> list[Planned]:
        cfg = self.cfg
        agent = ["--start", "--resume" if cfg.resume else "--no-resume", "--batched" if cfg.batched else "--no-batched",
                 "--min-observers", str(cfg.observers), *flags(cfg, _AGENT_FLAGS)]
        if cfg.checkpoint_every_steps:
            agent += ["--checkpoint-every-episodes", str(cfg.checkpoint_every_steps)]
        out = [Planned("agent", "agent", agent)]
        for i in range(cfg.observers):
            out.append(Planned(format_name("observer", i), "observer", flags(cfg, _OBSERVER_FLAGS)))
        return out

    def restartable(self, name: str) -> bool:
        return name != self.leader

    def watched(self, names: list[str]) -> list[str]:
        return [self.leader]

    def stop_waves(self, names: list[str]) -> list[list[str]]:
        return [[n for n in names if n != self.leader], [self.leader]]

    def finished(self, statuses: dict[str, dict]) -> bool:
        batch = (statuses.get(self.leader) or {}).get("batch") or {}
        return bool(batch.get("finished"))

    def progress(self, statuses: dict[str, dict]) -> list[dict]:
        s = statuses.get(self.leader) or {}
        events = []
        for h in s.get("history") or []:
            if h["episode"] > self._reported:
                events.append({"event": "progress", **h})
                self._reported = h["episode"]
        return events

    def summary(self, statuses: dict[str, dict], restarts: int) -> dict:
        s = statuses.get(self.leader) or {}
        batch = s.get("batch") or {}
        return {"event": "done", "solved": bool(batch.get("solved")), "episodes": s.get("episode") or 0,
                "episodes_this_run": batch.get("done", 0), "running_reward": s.get("running_reward"),
                "last_reward": s.get("last_reward"), "env_steps": s.get("env_steps", 0),
                "observers_lost": s.get("observers_lost", 0), "restarts": restarts}

    @staticmethod
    def human(e: dict) -> Optional[str]:
        if e["event"] == "progress":
            return (f"episode {e['episode']} | reward {e['reward']:.1f} | running reward {e['running_reward']:.1f} | "
                    f"{e['observers']} observers | {e['steps_per_s']:.0f} steps/s")
        if e["event"] == "done":
            rr = e["running_reward"]
            how = "solved" if e["solved"] else "not solved"
            return (f"done: {how} after {e['episodes']} episodes | running reward "
                    f"{'-' if rr is None else f'{rr:.1f}'} | {e['env_steps']} environment steps")
        return None


def make_workload(cfg: UpConfig) -> LmWorkload | RlWorkload:
    return RlWorkload(cfg) if cfg.workload == "rl" else LmWorkload(cfg)


def flags(cfg: UpConfig, fields: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for f in fields:
        v: Any = getattr(cfg, f)
        if v is not None:
            out += ["--" + f.replace("_", "-"), str(v)]
    return out
