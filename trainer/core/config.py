"""What every trainer of a server-hosted workload is told, besides its workload's own settings:
its share of the trainers, how it steps, where the dense weights live, and how it fails."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ps.spec.config import FULL_EVERY_HELP, ServersConfig
from ps.spec.consistency import Consistency, checked
from ps.spec.counting import check_mode
from services.config import ConfigBase

Dense = Literal["ps", "allreduce"]
DENSE_HELP = ("where the model's dense layers live: ps (on the servers, fetched each step) or allreduce (replicated "
              "on every trainer and kept in step by DDP's all-reduce among them; with --consistency sync or hybrid). "
              "Default: the consistency's (allreduce for hybrid, else ps)")


def dense_for(dense: Optional[str], consistency: str) -> str:
    """Where the dense weights live: ``dense``, or the consistency's own place for them when not
    given; ``ValueError`` when that mode cannot keep them there."""
    mode = Consistency.parse(consistency)
    chosen = dense or mode.dense_modes[0]
    mode.check_dense(chosen)
    return chosen


_REPLICATED_ROWS = ("--cache-staleness 0 keeps the hot rows exact by replicating them among the trainers, which step "
                   "them together with the dense weights: it needs --dense allreduce (--consistency sync or "
                   "hybrid); or give --cache-staleness S > 0 for copies up to S steps old, in async, ssp or hybrid")


def replicated_rows_need_replica(cached: bool, staleness: int, dense: Optional[str]) -> None:
    """``dense``: where the dense weights live (None: not known yet, the servers' consistency decides)."""
    if cached and staleness == 0 and dense not in (None, "allreduce"):
        raise ValueError(_REPLICATED_ROWS)


class TrainerSettings(ServersConfig):
    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("num_trainers",),
        "consistency": ("dense", "group_timeout", "slow_down", "slow_fraction"),
        "failures": ("max_refused_steps", "server_wait"), "output": ("log_interval",)}
    num_trainers: int = Field(2, ge=1, description="how many disjoint shares the training data is cut into")
    clip: float = Field(0.25, ge=0, description="global gradient-norm clip (0: off)")
    start: bool = Field(False, description="start an episode at launch instead of waiting for one")
    steps: Optional[int] = Field(None, ge=1, description="steps of the episode started at launch (default: unbounded)")
    dense: Optional[Dense] = Field(None, description=DENSE_HELP)
    group_timeout: float = Field(30.0, gt=0, description="--dense allreduce: seconds the trainers' process group "
                                                         "waits for a member, forming it and in each all-reduce "
                                                         "(at most --rpc-timeout, which rpcps up sets to its "
                                                         "--member-timeout)")
    exit_when_done: bool = Field(False, description="stop, with exit 0, when the episode started at launch ends "
                                                    "(a batch job: under torchrun, the default)")
    seed: int = Field(1111, description="seed of the trainer's randomness (dropout, stragglers, generated data)")
    log_interval: float = Field(10.0, gt=0, description="seconds between progress lines in the log")
    warmup_steps: int = Field(1, ge=0, description="first steps of an episode left out of its throughput")
    max_refused_steps: int = Field(5, ge=1, description="stop with an error after this many steps in a row whose "
                                                         "update the servers refused (gradients not finite)")
    server_wait: float = Field(600.0, gt=0, description="seconds a trainer waits for a parameter server that went "
                                                         "away under a step to serve again, then stops with an error")
    slow_down: float = Field(1.0, ge=1.0, le=100.0, description="run at 1/N speed: idle N-1 times each step's "
                                                                   "work after it (a straggler, for benchmarks and tests)")
    slow_fraction: float = Field(1.0, gt=0.0, le=1.0, description="slow down only this fraction of steps, drawn "
                                                                    "at random (seeded by --seed and --name)")

    @model_validator(mode="after")
    def _launched_episode(self) -> "TrainerSettings":
        if self.exit_when_done and not self.start:
            raise ValueError("--exit-when-done ends the episode started at launch: add --start")
        return self


class TrainersUpSettings(ConfigBase):
    """What `rpcps up` takes for every workload of servers and trainers; each adds its model and data."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("num_ps", "num_trainers"),
        "consistency": ("consistency", "dense", "straggler", "jitter", "jitter_fraction", "count_updates"),
        "checkpoints": ("checkpoint_every_steps", "checkpoint_every_seconds", "full_checkpoint_every")}

    # The roles' names for the same counts; the old spellings still work.
    num_ps: int = Field(2, ge=1, le=16, description="parameter servers to start",
                        json_schema_extra={"aliases": ("--ps",), "env_aliases": ("RPCPS_PS",)})
    num_trainers: int = Field(2, ge=1, le=64, description="trainers to start",
                              json_schema_extra={"aliases": ("--trainers",), "env_aliases": ("RPCPS_TRAINERS",)})
    steps: Optional[int] = Field(None, ge=1, description="steps per trainer, then stop and exit 0 (default: until Ctrl-C)")
    seed: int = Field(1111, description="seed of the initial parameters, dropout and the generated data")
    clip: float = Field(0.25, ge=0, description="global gradient-norm clip (0: off)")
    warmup_steps: int = Field(1, ge=0, description="first steps of an episode left out of the throughput")
    checkpoint_every_steps: Optional[int] = Field(None, ge=1, description="checkpoint every N cluster steps")
    checkpoint_every_seconds: Optional[float] = Field(None, gt=0, description="checkpoint every M seconds")
    full_checkpoint_every: int = Field(1, ge=1, description=FULL_EVERY_HELP)
    consistency: str = Field("async", description="how the servers apply updates: async, sync, hybrid or ssp:K")
    dense: Optional[Dense] = Field(None, description=DENSE_HELP)
    straggler: float = Field(1.0, ge=1.0, le=100.0, description="run trainer 0 at 1/N speed (its --slow-down), "
                                                                 "a straggler for benchmarks")
    jitter: float = Field(1.0, ge=1.0, le=100.0, description="every trainer runs at 1/N speed on a random "
                                                              "--jitter-fraction of its steps (benchmarks)")
    jitter_fraction: float = Field(0.25, gt=0.0, le=1.0, description="the fraction of steps --jitter slows")
    count_updates: bool = Field(False, description="the servers count each row's updates and the trainers their "
                                                   "acknowledged steps', by slot (GET /counts on each): that no "
                                                   "update is lost or applied twice shown (async, ssp)")

    _consistency = field_validator("consistency")(classmethod(lambda cls, v: checked(v)))

    @model_validator(mode="after")
    def _one_slow_down(self) -> "TrainersUpSettings":
        if self.straggler > 1.0 and self.jitter > 1.0:
            raise ValueError("--straggler and --jitter both slow trainer 0 down: choose one")
        dense_for(self.dense, self.consistency)
        if self.count_updates:
            check_mode(self.consistency)
        return self

    @property
    def dense_at(self) -> str:
        """Where the dense weights live: ``--dense``, or the consistency's default."""
        return dense_for(self.dense, self.consistency)
