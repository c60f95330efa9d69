"""The language-model workload's settings: its model, its servers' and trainers', and what
`rpcps up --workload lm` takes."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ps.config import PsConfig, ServersConfig
from ps.consistency import checked
from services.config import ConfigBase
from trainer.lm.text import check_folder, check_size


def _folder(cls: type, v: Optional[Path]) -> Optional[Path]:
    return v if v is None else check_folder(v)


def _sized(data: Optional[Path], trainers: int, batch_size: int) -> None:
    if data is not None:
        try:
            check_size(data, trainers, batch_size)
        except ValueError as exc:
            raise ValueError(f"--data: {exc}") from None


Dense = Literal["ps", "allreduce"]
DENSE_HELP = ("where the LSTM lives: ps (on the servers, fetched each step) or allreduce (replicated on every "
              "trainer and kept in step by DDP's all-reduce among them; needs --consistency sync)")


def dense_needs_sync(dense: str, consistency: str) -> None:
    if dense == "allreduce" and consistency != "sync":
        raise ValueError(f"--dense allreduce updates synchronously (the replicas all-reduce every step), but the "
                         f"consistency is {consistency}: use --consistency sync, or --dense ps")


class LmModelConfig(ConfigBase):
    """The model's shape and training rule: the servers' truth (their ``ModelSpec.meta``), which
    trainers fetch on join."""

    ntoken: int = Field(ge=2, description="vocabulary size (rows of the embedding and decoder)")
    emsize: int = Field(200, ge=1)
    nhid: int = Field(200, ge=1)
    nlayers: int = Field(2, ge=1)
    init_range: float = Field(0.1, gt=0)
    seed: int = 1111
    optimizer: Literal["sgd", "adagrad"] = "sgd"
    lr: float = Field(20.0, gt=0)


class LmServerConfig(PsConfig):
    """`rpcps ps --workload lm`: a parameter server hosting the language model."""

    ntoken: Optional[int] = Field(None, ge=2, description="vocabulary size; default: from --data")
    data: Optional[Path] = Field(None, description="corpus folder, read only to size the vocabulary")
    _data = field_validator("data")(classmethod(_folder))
    emsize: int = Field(200, ge=1, description="embedding size")
    nhid: int = Field(200, ge=1, description="LSTM hidden size")
    nlayers: int = Field(2, ge=1, le=16, description="LSTM layers")
    init_range: float = Field(0.1, gt=0, description="uniform init range of embedding and decoder")
    seed: int = Field(1111, description="seed of the parameter init")
    optimizer: Literal["sgd", "adagrad"] = Field("sgd", description="the servers' optimizer (both take sparse grads)")
    lr: float = Field(20.0, gt=0, description="learning rate")


class TrainerConfig(ServersConfig):
    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("num_trainers",),
        "consistency": ("dense", "group_timeout", "slow_down", "slow_fraction"),
        "failures": ("max_refused_steps",), "output": ("log_interval",)}
    name: str = Field("trainer0", description="RPC name: trainer<index>")
    data: Optional[Path] = Field(None, description="WikiText-style folder; default: built-in synthetic corpus")
    _data = field_validator("data")(classmethod(_folder))
    num_trainers: int = Field(2, ge=1, description="how many disjoint shares the training text is cut into")
    batch_size: int = Field(20, ge=1, description="sequences per step")
    bptt: int = Field(35, ge=1, description="tokens per sequence per step")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout on embeddings, between layers, before the decoder")
    clip: float = Field(0.25, ge=0, description="global gradient-norm clip (0: off)")
    start: bool = Field(False, description="start an episode at launch instead of waiting for one")
    steps: Optional[int] = Field(None, ge=1, description="steps of the episode started at launch (default: unbounded)")
    dense: Dense = Field("ps", description=DENSE_HELP)
    group_timeout: float = Field(30.0, gt=0, description="--dense allreduce: seconds the trainers' process group "
                                                         "waits for a member, forming it and in each all-reduce")
    exit_when_done: bool = Field(False, description="stop, with exit 0, when the episode started at launch ends "
                                                    "(a batch job: under torchrun, the default)")
    eval_batch_size: int = Field(10, ge=1, description="sequences per evaluation batch")
    eval_tokens: Optional[int] = Field(None, ge=1, description="cap on held-out tokens evaluated (whole cluster)")
    synthetic_tokens: int = Field(200_000, ge=1000, description="size of the built-in corpus")
    seed: int = Field(1111, description="seed of dropout and the synthetic corpus")
    log_interval: float = Field(10.0, gt=0, description="seconds between progress lines in the log")
    warmup_steps: int = Field(1, ge=0, description="first steps of an episode left out of its tokens/s")
    max_refused_steps: int = Field(5, ge=1, description="stop with an error after this many steps in a row whose "
                                                         "update the servers refused (gradients not finite)")
    slow_down: float = Field(1.0, ge=1.0, le=100.0, description="run at 1/N speed: idle N-1 times each step's "
                                                                   "work after it (a straggler, for benchmarks and tests)")
    slow_fraction: float = Field(1.0, gt=0.0, le=1.0, description="slow down only this fraction of steps, drawn "
                                                                    "at random (seeded by --seed and --name)")

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        self._check_role("trainer")
        if self.exit_when_done and not self.start:
            raise ValueError("--exit-when-done ends the episode started at launch: add --start")
        _sized(self.data, self.num_trainers, self.batch_size)
        return self


class LmUpSettings(ConfigBase):
    """`rpcps up --workload lm`: the servers' and trainers' settings a local cluster starts with."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("num_ps", "num_trainers"),
        "consistency": ("consistency", "dense", "straggler", "jitter", "jitter_fraction"),
        "checkpoints": ("checkpoint_every_steps", "checkpoint_every_seconds")}

    # The roles' names for the same counts; the old spellings still work.
    num_ps: int = Field(2, ge=1, le=16, description="parameter servers to start",
                        json_schema_extra={"aliases": ("--ps",), "env_aliases": ("RPCPS_PS",)})
    num_trainers: int = Field(2, ge=1, le=64, description="trainers to start",
                              json_schema_extra={"aliases": ("--trainers",), "env_aliases": ("RPCPS_TRAINERS",)})
    steps: Optional[int] = Field(None, ge=1, description="steps per trainer, then stop and exit 0 (default: until Ctrl-C)")
    data: Optional[Path] = Field(None, description="WikiText-style folder (default: built-in synthetic corpus)")
    _data = field_validator("data")(classmethod(_folder))
    ntoken: Optional[int] = Field(None, ge=2, description="vocabulary rows (default: the corpus vocabulary)")
    emsize: int = Field(200, ge=1, description="embedding size")
    nhid: int = Field(200, ge=1, description="LSTM hidden size")
    nlayers: int = Field(2, ge=1, le=16, description="LSTM layers")
    optimizer: Literal["sgd", "adagrad"] = Field("sgd", description="the servers' optimizer")
    lr: float = Field(20.0, gt=0, description="learning rate")
    seed: int = Field(1111, description="seed of init, dropout and the synthetic corpus")
    batch_size: int = Field(20, ge=1, description="sequences per trainer step")
    bptt: int = Field(35, ge=1, description="tokens per sequence per step")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout")
    clip: float = Field(0.25, ge=0, description="global gradient-norm clip (0: off)")
    eval_tokens: Optional[int] = Field(None, ge=1, description="cap on held-out tokens evaluated per episode")
    synthetic_tokens: int = Field(200_000, ge=1000, description="size of the built-in corpus")
    warmup_steps: int = Field(1, ge=0, description="first steps of an episode left out of tokens/s")
    checkpoint_every_steps: Optional[int] = Field(None, ge=1, description="checkpoint every N cluster steps")
    checkpoint_every_seconds: Optional[float] = Field(None, gt=0, description="checkpoint every M seconds")
    consistency: str = Field("async", description="how the servers apply updates: async, sync or ssp:K")
    dense: Dense = Field("ps", description=DENSE_HELP)
    straggler: float = Field(1.0, ge=1.0, le=100.0, description="run trainer0 at 1/N speed (its --slow-down), "
                                                                 "a straggler for benchmarks")
    jitter: float = Field(1.0, ge=1.0, le=100.0, description="every trainer runs at 1/N speed on a random "
                                                              "--jitter-fraction of its steps (benchmarks)")
    jitter_fraction: float = Field(0.25, gt=0.0, le=1.0, description="the fraction of steps --jitter slows")

    _consistency = field_validator("consistency")(classmethod(lambda cls, v: checked(v)))

    @model_validator(mode="after")
    def _one_slow_down(self) -> "LmUpSettings":
        if self.straggler > 1.0 and self.jitter > 1.0:
            raise ValueError("--straggler and --jitter both slow trainer0 down: choose one")
        dense_needs_sync(self.dense, self.consistency)
        _sized(self.data, self.num_trainers, self.batch_size)
        return self
