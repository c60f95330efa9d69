"""The language-model workload's settings: its model, its servers' and trainers', and what
`rpcps up --workload lm` takes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field, field_validator, model_validator

from ps.spec.config import PsConfig
from ps.spec.rules import choices as rule_choices
from services.config import ConfigBase
from trainer.core.config import TrainerSettings, TrainersUpSettings
from trainer.lm.text import check_folder, check_size

DenseRule = rule_choices(tables=False)      # the registry's rules that step a dense parameter


def _folder(cls: type, v: Optional[Path]) -> Optional[Path]:
    return v if v is None else check_folder(v)


def _sized(data: Optional[Path], trainers: int, batch_size: int) -> None:
    if data is not None:
        try:
            check_size(data, trainers, batch_size)
        except ValueError as exc:
            raise ValueError(f"--data: {exc}") from None


class LmModelConfig(ConfigBase):
    """The model's shape and training rule: the servers' truth (their ``ModelSpec.meta``), which
    trainers fetch on join."""

    ntoken: int = Field(ge=2, description="vocabulary size (rows of the embedding and decoder)")
    emsize: int = Field(200, ge=1)
    nhid: int = Field(200, ge=1)
    nlayers: int = Field(2, ge=1)
    init_range: float = Field(0.1, gt=0)
    seed: int = 1111
    optimizer: DenseRule = "sgd"
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
    optimizer: DenseRule = Field("sgd", description="the servers' optimizer (both take sparse grads)")
    lr: float = Field(20.0, gt=0, description="learning rate")


class TrainerConfig(TrainerSettings):
    """`rpcps trainer`: a language-model trainer."""

    name: str = Field("trainer0", description="RPC name: trainer<index>")
    data: Optional[Path] = Field(None, description="WikiText-style folder; default: built-in synthetic corpus")
    _data = field_validator("data")(classmethod(_folder))
    batch_size: int = Field(20, ge=1, description="sequences per step")
    bptt: int = Field(35, ge=1, description="tokens per sequence per step")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout on embeddings, between layers, before the decoder")
    eval_batch_size: int = Field(10, ge=1, description="sequences per evaluation batch")
    eval_tokens: Optional[int] = Field(None, ge=1, description="cap on held-out tokens evaluated (whole cluster)")
    synthetic_tokens: int = Field(200_000, ge=1000, description="size of the built-in corpus")

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        self._check_role("trainer")
        _sized(self.data, self.num_trainers, self.batch_size)
        return self


class LmUpSettings(TrainersUpSettings):
    """`rpcps up --workload lm`: the servers' and trainers' settings a local cluster starts with."""

    data: Optional[Path] = Field(None, description="WikiText-style folder (default: built-in synthetic corpus)")
    _data = field_validator("data")(classmethod(_folder))
    ntoken: Optional[int] = Field(None, ge=2, description="vocabulary rows (default: the corpus vocabulary)")
    emsize: int = Field(200, ge=1, description="embedding size")
    nhid: int = Field(200, ge=1, description="LSTM hidden size")
    nlayers: int = Field(2, ge=1, le=16, description="LSTM layers")
    optimizer: DenseRule = Field("sgd", description="the servers' optimizer")
    lr: float = Field(20.0, gt=0, description="learning rate")
    batch_size: int = Field(20, ge=1, description="sequences per trainer step")
    bptt: int = Field(35, ge=1, description="tokens per sequence per step")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout")
    eval_tokens: Optional[int] = Field(None, ge=1, description="cap on held-out tokens evaluated per episode")
    synthetic_tokens: int = Field(200_000, ge=1000, description="size of the built-in corpus")

    @model_validator(mode="after")
    def _sized_data(self) -> "LmUpSettings":
        _sized(self.data, self.num_trainers, self.batch_size)
        return self
