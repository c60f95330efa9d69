"""Typed configuration, one pydantic model per role.

Every field can be set by a flag (``--field-name``) or an environment variable (``RPCPS_FIELD_NAME``);
flags win. Rendezvous uses torch's own ``MASTER_ADDR``/``MASTER_PORT``. ``load`` is pure: it takes
the environment as an argument, so tests need no monkeypatching.
"""
from __future__ import annotations

import argparse
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from services.errors import ConfigError
from services.names import parse_name

log = logging.getLogger(__name__)

ENV_PREFIX = "RPCPS_"
# Fields read from torch's standard variables instead of RPCPS_*.
_TORCH_ENV = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}


def _extra(info: Any, key: str) -> Optional[str]:
    extra = getattr(info, "json_schema_extra", None)
    return extra.get(key) if isinstance(extra, dict) else None


def env_name(field: str, info: Any = None) -> str:
    return _extra(info, "env") or _TORCH_ENV.get(field, ENV_PREFIX + field.upper())


def flag_name(field: str, info: Any = None) -> str:
    return _extra(info, "flag") or "--" + field.replace("_", "-")


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CommonConfig(_Base):
    name: str = Field(description="RPC name of this process (ps0, trainer1, ...)")
    master_addr: str = Field("127.0.0.1", description="address of the leader (ps0, or the RL agent), which hosts the rendezvous store")
    master_port: int = Field(29500, ge=1, le=65535, description="port of the rendezvous store on the leader")
    sidecar_host: str = Field("127.0.0.1", description="address the HTTP sidecar binds")
    sidecar_port: int = Field(8080, ge=0, le=65535, description="port of the HTTP sidecar (0: any free port)")
    checkpoint_dir: Path = Field(Path("checkpoints"), description="folder of the cluster checkpoints")
    control_token: Optional[SecretStr] = Field(None, description="bearer token required by POST routes")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads (1 is steadiest on small hosts)")
    rpc_timeout: float = Field(60.0, gt=0, description="seconds before an RPC fails")
    join_timeout: float = Field(300.0, gt=0, description="seconds to wait for the cluster when joining")
    rpc_transport: Literal["uv", "shm"] = Field(
        "uv", description="TensorPipe transport: uv (TCP) or shm (lower latency, but busy-polls a core)")

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        parse_name(v)
        return v

    def _check_role(self, role: str) -> None:
        if parse_name(self.name).role != role:
            raise ValueError(f"name {self.name!r} is not a {role} name")


class ModelConfig(_Base):
    """The model's shape and training rule: the servers' truth, which trainers fetch on join."""

    ntoken: int = Field(ge=2, description="vocabulary size (rows of the embedding and decoder)")
    emsize: int = Field(200, ge=1)
    nhid: int = Field(200, ge=1)
    nlayers: int = Field(2, ge=1)
    init_range: float = Field(0.1, gt=0)
    seed: int = 1111
    optimizer: Literal["sgd", "adagrad"] = "sgd"
    lr: float = Field(20.0, gt=0)


class RestoringConfig(_Base):
    """A role that saves state in checkpoints and starts from them."""

    resume: bool = Field(True, description="start from the newest valid checkpoint in --checkpoint-dir")
    resume_from: Optional[str] = Field(None, description="start from this checkpoint (step-N or its path)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept; older ones removed after a newer completes")


class LeaderConfig(_Base):
    """What the leader (ps0, the agent) uses to watch the group's members."""

    probe_interval: float = Field(1.0, gt=0, description="seconds between liveness probes of members (leader)")
    probe_failures: int = Field(2, ge=1, description="failed probes in a row before a member is evicted (leader)")


class _LmConfig(CommonConfig):
    num_ps: int = Field(2, ge=1, le=64, description="number of parameter servers (shards) in the cluster")


class PsConfig(_LmConfig, RestoringConfig, LeaderConfig):
    name: str = Field("ps0", description="RPC name: ps<index>, index < num_ps")
    ntoken: Optional[int] = Field(None, ge=2, description="vocabulary size; default: from --data")
    data: Optional[Path] = Field(None, description="corpus folder, read only to size the vocabulary")
    emsize: int = Field(200, ge=1, description="embedding size")
    nhid: int = Field(200, ge=1, description="LSTM hidden size")
    nlayers: int = Field(2, ge=1, le=16, description="LSTM layers")
    init_range: float = Field(0.1, gt=0, description="uniform init range of embedding and decoder")
    seed: int = Field(1111, description="seed of the parameter init")
    optimizer: Literal["sgd", "adagrad"] = Field("sgd", description="the servers' optimizer (both take sparse grads)")
    lr: float = Field(20.0, gt=0, description="learning rate")
    checkpoint_every_steps: Optional[int] = Field(None, ge=1, description="take a checkpoint every N cluster steps (ps0)")
    checkpoint_every_seconds: Optional[float] = Field(None, gt=0, description="take a checkpoint every M seconds (ps0)")

    @model_validator(mode="after")
    def _check(self) -> "PsConfig":
        self._check_role("ps")
        if parse_name(self.name).index >= self.num_ps:
            raise ValueError(f"name {self.name!r} needs num_ps > {parse_name(self.name).index}, got {self.num_ps}")
        return self


class TrainerConfig(_LmConfig):
    name: str = Field("trainer0", description="RPC name: trainer<index>")
    data: Optional[Path] = Field(None, description="WikiText-style folder; default: built-in synthetic corpus")
    num_trainers: int = Field(2, ge=1, description="how many disjoint shares the training text is cut into")
    batch_size: int = Field(20, ge=1, description="sequences per step")
    bptt: int = Field(35, ge=1, description="tokens per sequence per step")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout on embeddings, between layers, before the decoder")
    clip: float = Field(0.25, ge=0, description="global gradient-norm clip (0: off)")
    start: bool = Field(False, description="start an episode at launch instead of waiting for one")
    steps: Optional[int] = Field(None, ge=1, description="steps of the episode started at launch (default: unbounded)")
    eval_batch_size: int = Field(10, ge=1, description="sequences per evaluation batch")
    eval_tokens: Optional[int] = Field(None, ge=1, description="cap on held-out tokens evaluated (whole cluster)")
    synthetic_tokens: int = Field(200_000, ge=1000, description="size of the built-in corpus")
    seed: int = Field(1111, description="seed of dropout and the synthetic corpus")
    log_interval: float = Field(10.0, gt=0, description="seconds between progress lines in the log")
    warmup_steps: int = Field(1, ge=0, description="first steps of an episode left out of its tokens/s")

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        self._check_role("trainer")
        return self


ENV_PATTERN = r"^(CartPole-v1(:[1-9][0-9]*)?|fixed:[1-9][0-9]*)$"


class AgentConfig(CommonConfig, RestoringConfig, LeaderConfig):
    name: str = Field("agent", description="RPC name: agent")
    checkpoint_dir: Path = Field(Path("checkpoints/rl"), description="folder of the agent's checkpoints")
    env: str = Field("CartPole-v1", pattern=ENV_PATTERN, description="the observers' environment: CartPole-v1; CartPole-v1:<steps> (restarted until that many, for benchmarks); fixed:<steps> (tests)")
    batched: bool = Field(True, description="one forward pass per step for all observers (--no-batched: the seed's one per observer)")
    hidden: int = Field(128, ge=1, description="hidden units of the policy")
    dropout: float = Field(0.6, ge=0, lt=1, description="dropout in the policy")
    lr: float = Field(1e-2, gt=0, description="Adam learning rate")
    gamma: float = Field(0.99, gt=0, le=1, description="discount factor")
    seed: int = Field(1, description="seed of the policy, its dropout and action draws, and the environments")
    start: bool = Field(False, description="start episodes at launch instead of waiting for a request")
    episodes: Optional[int] = Field(None, ge=1, description="episodes started at launch (default: until solved)")
    max_steps: Optional[int] = Field(None, ge=1, description="cap on environment steps per observer episode (default: the environment's)")
    min_observers: int = Field(1, ge=1, description="observers needed before the first episode starts (later ones go on with whoever is there)")
    checkpoint_every_episodes: Optional[int] = Field(None, ge=1, description="take a checkpoint every N episodes")

    @model_validator(mode="after")
    def _check(self) -> "AgentConfig":
        self._check_role("agent")
        return self


class ObserverConfig(CommonConfig):
    name: str = Field("observer0", description="RPC name: observer<index>")
    env: str = Field("CartPole-v1", pattern=ENV_PATTERN, description="environment to step: CartPole-v1, CartPole-v1:<steps> or fixed:<steps> (see rpcps agent --help)")
    seed: int = Field(1, description="seed of the environment (with the observer's index)")

    @model_validator(mode="after")
    def _check(self) -> "ObserverConfig":
        self._check_role("observer")
        return self


def _plain_type(annotation: Any) -> Any:
    """The non-None member of Optional[X], else the annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """One flag per field. Values stay strings (None when absent) so pydantic validates them and
    names the field in its error, the same way for flags and variables."""
    for field, info in model.model_fields.items():
        if field in skip:
            continue
        kind = _plain_type(info.annotation)
        help_text = f"{info.description or ''} [env {env_name(field, info)}]"
        if kind is bool:
            parser.add_argument(flag_name(field, info), dest=field, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
            parser.add_argument(flag_name(field, info), dest=field, default=None, choices=choices,
                                metavar=field.upper(), help=help_text)


def load(model: type[_Base], flags: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    """Merge environment and flags (flags win) and validate; raise ConfigError naming the source."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for field, info in model.model_fields.items():
        var = env_name(field, info)
        if var in environ and environ[var] != "":
            values[field], source[field] = environ[var], f"environment variable {var}"
        if flags.get(field) is not None:
            values[field], source[field] = flags[field], f"flag {flag_name(field, info)}"
    known = {env_name(f, i) for f, i in model.model_fields.items()}
    for var in environ:
        # Shared environments (compose, k8s) set variables for several roles at once; only warn.
        if var.startswith(ENV_PREFIX) and var not in known:
            log.warning("ignoring %s: %s has no such setting", var, model.__name__)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            info = model.model_fields.get(field)
            where = source.get(field, f"{flag_name(field, info)} / {env_name(field, info)}" if info else "configuration")
            got = f", got {values[field]!r}" if field in values else ""
            problems.append(f"{where}: {err['msg']}{got}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None


class UpConfig(_Base):
    """``rpcps up``: a whole cluster as local processes."""

    workload: Literal["lm", "rl"] = Field("lm", description="lm: servers and trainers; rl: the agent and its observers")
    ps: int = Field(2, ge=1, le=16, description="parameter servers to start")
    trainers: int = Field(2, ge=1, le=64, description="trainers to start")
    steps: Optional[int] = Field(None, ge=1, description="steps per trainer, then stop and exit 0 (default: until Ctrl-C)")
    observers: int = Field(4, ge=1, le=64, description="rl: observers to start")
    episodes: Optional[int] = Field(None, ge=1, description="rl: episodes to run at most (default: until solved)")
    env: str = Field("CartPole-v1", pattern=ENV_PATTERN, description="rl: environment (CartPole-v1; CartPole-v1:<steps> or fixed:<steps>, see rpcps agent --help)")
    batched: bool = Field(True, description="rl: one forward pass per step for all observers (--no-batched: the seed's way)")
    max_steps: Optional[int] = Field(None, ge=1, description="rl: cap on steps per observer episode")
    as_json: bool = Field(False, description="print JSON lines instead of human progress",
                          json_schema_extra={"flag": "--json", "env": "RPCPS_JSON"})
    data: Optional[Path] = Field(None, description="WikiText-style folder (default: built-in synthetic corpus)")
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
    threads: int = Field(1, ge=1, description="torch threads per process")
    rpc_transport: Literal["uv", "shm"] = Field("uv", description="TensorPipe transport of every role")
    master_addr: str = Field("127.0.0.1", description="address of the rendezvous store (the leader: ps0 or the agent)")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port (0: a free port)")
    sidecar_host: str = Field("127.0.0.1", description="address the sidecars bind")
    sidecar_port: int = Field(0, ge=0, le=65535, description="first sidecar port, one per role in order (0: free ports)")
    progress_interval: float = Field(5.0, gt=0, description="seconds between progress lines")
    max_restarts: int = Field(3, ge=0, description="trainer restarts allowed within --restart-window")
    restart_window: float = Field(60.0, gt=0, description="seconds over which restarts are counted")
    ready_timeout: float = Field(180.0, gt=0, description="seconds for every role to become ready")
    state_dir: Path = Field(Path(".rpcps"), description="where role logs and cluster.json go")
    resume: bool = Field(True, description="resume from the newest valid checkpoint (--no-resume: start fresh)")
    resume_from: Optional[str] = Field(None, description="resume from this checkpoint (step-N or its path)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept")
    checkpoint_every_steps: Optional[int] = Field(None, ge=1, description="checkpoint every N cluster steps (rl: episodes)")
    checkpoint_every_seconds: Optional[float] = Field(None, gt=0, description="checkpoint every M seconds")
    final_checkpoint: bool = Field(True, description="take a checkpoint when stopping")
    checkpoint_dir: Optional[Path] = Field(None, description="folder of the checkpoints (default: checkpoints, or checkpoints/rl for rl)")
    control_token: Optional[SecretStr] = Field(None, description="bearer token for the sidecars' POST routes")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level of every role")

    @model_validator(mode="after")
    def _check(self) -> "UpConfig":
        # A setting of the other workload would be silently ignored: refuse it instead.
        other = _LM_ONLY if self.workload == "rl" else _RL_ONLY
        wrong = sorted(self.model_fields_set & other)
        if wrong:
            raise ValueError(f"{', '.join(flag_name(f) for f in wrong)}: not a setting of --workload {self.workload}")
        return self


_LM_ONLY = {"ps", "trainers", "steps", "data", "ntoken", "emsize", "nhid", "nlayers", "optimizer", "lr", "batch_size",
            "bptt", "dropout", "clip", "eval_tokens", "synthetic_tokens", "warmup_steps", "checkpoint_every_seconds"}
_RL_ONLY = {"observers", "episodes", "env", "batched", "max_steps"}
