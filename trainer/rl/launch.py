"""`rpcps up --workload rl`: the agent and its observers as local processes, and how their
progress reads. The agent leads."""
from __future__ import annotations

from typing import Any, Optional

from supervise.upconfig import LauncherConfig, flags
from services.names import format_name
from services.progress import combine, describe
from services.workload import Planned
from trainer.rl.config import RlUpSettings
from trainer.rl.status import AgentStatus

LEADER = "agent"
_AGENT_FLAGS = ("env", "seed", "episodes", "max_steps")
_OBSERVER_FLAGS = ("env", "seed")


class RlLaunch:
    def __init__(self, common: LauncherConfig, settings: RlUpSettings) -> None:
        self.common, self.cfg = common, settings
        self._reported = 0       # the last episode a progress event was emitted for

    def plan(self) -> list[Planned]:
        cfg = self.cfg
        agent = ["--start", "--batched" if cfg.batched else "--no-batched", "--min-observers", str(cfg.observers),
                 *self.common.restoring_flags(), *flags(cfg, _AGENT_FLAGS)]
        every = cfg.checkpoint_every_episodes or cfg.checkpoint_every_steps
        if every:
            agent += ["--checkpoint-every-episodes", str(every)]
        return [Planned(LEADER, "agent", agent),
                *(Planned(format_name("observer", i), "observer", flags(cfg, _OBSERVER_FLAGS))
                  for i in range(cfg.observers))]

    def watched(self, names: list[str]) -> list[str]:
        return [LEADER]

    def stop_waves(self, names: list[str]) -> list[list[str]]:
        return [[n for n in names if n != LEADER], [LEADER]]

    def finished(self, statuses: dict[str, AgentStatus]) -> bool:
        agent = statuses.get(LEADER)
        return bool(agent and agent.batch and agent.batch.finished)

    def progress(self, statuses: dict[str, AgentStatus]) -> list[dict]:
        agent = statuses.get(LEADER) or AgentStatus()
        events = []
        for h in agent.history:
            if h["episode"] > self._reported:
                events.append({"event": "progress", **h})
                self._reported = h["episode"]
        if events:     # the batch's progress as the agent last reported it, on the newest episode
            batch = agent.batch
            events[-1].update(episodes=batch.episodes if batch else None, done=batch.done if batch else 0,
                              **combine([agent.progress], "episodes"))
        return events

    def summary(self, statuses: dict[str, AgentStatus], restarts: int) -> dict:
        agent = statuses.get(LEADER) or AgentStatus()
        batch = agent.batch
        return {"event": "done", "solved": bool(batch and batch.solved), "episodes": agent.episode,
                "episodes_this_run": batch.done if batch else 0, "running_reward": agent.running_reward,
                "last_reward": agent.last_reward, "env_steps": agent.env_steps,
                "observers_lost": agent.observers_lost, "restarts": restarts}

    def human(self, e: dict[str, Any]) -> Optional[str]:
        if e["event"] == "progress":
            of = f" ({e['done']}/{e['episodes']} this run)" if e.get("episodes") else ""
            return " | ".join(p for p in (
                f"episode {e['episode']}{of}", describe(e), f"reward {e['reward']:.1f}",
                f"running reward {e['running_reward']:.1f}", f"{e['observers']} observers",
                f"{e['steps_per_s']:.0f} steps/s") if p)
        if e["event"] == "done":
            rr = e["running_reward"]
            how = "solved" if e["solved"] else "not solved"
            return (f"done: {how} after {e['episodes']} episodes | running reward "
                    f"{'-' if rr is None else f'{rr:.1f}'} | {e['env_steps']} environment steps")
        return None
