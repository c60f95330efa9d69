"""The parameter servers' settings, and the names of a cluster's servers."""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator

from services.config import CommonConfig, ConfigBase, LeaderConfig, RestoringConfig
from services.names import format_name, parse_name


def ps_names(num_ps: int) -> list[str]:
    return [format_name("ps", i) for i in range(num_ps)]


class ServersConfig(CommonConfig):
    """A role of a cluster of parameter servers (the servers themselves and their clients)."""

    num_ps: int = Field(2, ge=1, le=64, description="number of parameter servers (shards) in the cluster")


class ModelConfig(ConfigBase):
    """The model's shape and training rule: the servers' truth, which trainers fetch on join."""

    ntoken: int = Field(ge=2, description="vocabulary size (rows of the embedding and decoder)")
    emsize: int = Field(200, ge=1)
    nhid: int = Field(200, ge=1)
    nlayers: int = Field(2, ge=1)
    init_range: float = Field(0.1, gt=0)
    seed: int = 1111
    optimizer: Literal["sgd", "adagrad"] = "sgd"
    lr: float = Field(20.0, gt=0)



class PsConfig(ServersConfig, RestoringConfig, LeaderConfig):
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
