"""What every trainer of a server-hosted workload shows on /status; its workload adds its throughput
(named by its unit), its evaluation and its own fields."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from services.lifecycle import RoleStatus


class EpisodeProgress(BaseModel):
    id: int
    step: int = 0
    steps: Optional[int] = None        # the episode's target (None: unbounded)
    done: bool = False


class ReplicaState(BaseModel):
    """--dense allreduce: this trainer's replica of the dense weights."""

    step: int                          # the step clock's step its weights are at (-1: the servers' weights)
    digest: str                        # sha256 of its weights, shortened: equal on every trainer at one step
    allreduce_group: list[str]         # the trainers it last all-reduced with
    group_id: str = ""                 # that group's key: new with each group, even of the same names
    # (step, digest) of its last steps: trainers read at different moments compare at a step all took
    digests: list[tuple[int, str]] = []


class Traffic(BaseModel):
    """What this trainer's successful steps moved and where their time went: tensor bytes to and
    from the servers over RPC (distributed backward's gradients included), the messages that
    carried them, what it handed to the trainers' all-reduce, and the seconds of each phase, on the
    clock and of the training thread's CPU."""

    steps: int = 0
    rpc_bytes: int = 0
    rpcs: int = 0
    allreduce_bytes: int = 0
    bytes_saved: int = 0               # of rows taken from the trainer's cache instead of the servers
    timed_steps: int = 0               # those past the warm-up steps, which ``phase_seconds`` adds up
    phase_seconds: dict[str, float] = {}   # per phase (fetch, forward, backward, clip, optimize, barrier, total)
    # the training thread's CPU seconds of those steps per phase (batch, fetch, forward, backward, update, total)
    phase_cpu_seconds: dict[str, float] = {}


class RowCacheState(BaseModel):
    """``--cache-rows``: the trainer's copies of the rows it reads most (``ps/client/cache.py``)."""

    rows: int = 0                      # copies held
    hits: int = 0                      # ids its steps took from it
    misses: int = 0                    # ids they read from the servers instead
    hit_rate: float = 0.0
    lookups: int = 0                   # ids the steps' batches named, each as often as named
    lookup_hit_rate: float = 0.0       # of those, the share taken from the copies (as HET counts its hits)
    bytes_saved: int = 0               # of rows not read, as they would have crossed the wire
    oldest: int = 0                    # the oldest copy a step took, in the trainer's steps


class TrainerStatusBase(RoleStatus):
    step: int = 0                      # this trainer's steps, across episodes and restarts
    refused_steps: int = 0             # steps skipped because the servers refused their update
    lost_steps: int = 0                # steps skipped because they failed on their way (a peer died)
    server_losses: int = 0             # times a server went away under a step
    waiting_for: list[str] = []        # the servers this trainer waits to come back (lost under a step)
    waiting_s: Optional[float] = None  # how long it has waited for them
    dense_replica: Optional[ReplicaState] = None
    moved: Traffic = Traffic()
    cache: Optional[RowCacheState] = None
    episode: Optional[EpisodeProgress] = None
    episodes_completed: int = 0
    model: Optional[dict[str, Any]] = None
    data: Optional[str] = None
    consistency: Optional[str] = None  # the servers' (async, sync, ssp:K)
    loss: Optional[float] = None
    loss_avg: Optional[float] = None   # of the last 20 steps
    loss_first: Optional[float] = None
    grad_norm: Optional[float] = None
    step_seconds: Optional[dict[str, float]] = None
    step_cpu_seconds: Optional[dict[str, float]] = None   # the last step's, by phase, of its training thread
    evaluating: bool = False

    def steps_line(self) -> list[str]:
        """The columns every trainer's ``line`` starts with."""
        ep = self.episode
        return [f"step {self.step}",
                f"episode {ep.id if ep else '-'} {ep.step if ep else 0}/{(ep.steps if ep else None) or '∞'}",
                f"loss {self.loss_avg:.3f}" if self.loss_avg is not None else "loss -"]

    def failures_line(self) -> list[str]:
        return ([f"{self.refused_steps} steps refused"] if self.refused_steps else []) \
            + ([f"{self.lost_steps} steps lost"] if self.lost_steps else []) \
            + ([f"waiting for {', '.join(self.waiting_for)}"] if self.waiting_for else [])
