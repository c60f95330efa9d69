"""A model over a feature schema: a user's (``rpcps up --model pkg.mod:Class --schema s.yaml``) or
the built-in DLRM (``trainer/ctr/builtin.py``). Built the same way by every process, hosted by the
servers as ``trainer/core/hosted.py`` derives it, and trained by the CTR trainer's task."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ps.spec.model import ModelSpec
from rpcps.batch import Batch
from rpcps.model import ModelError, build_model, said
from rpcps.schema import Schema
from services.errors import ConfigError
from trainer.core.hosted import HostedModel, hosted_spec


def built(ref: str, schema: Schema, seed: int, options: Optional[dict[str, Any]] = None) -> nn.Module:
    """``rpcps.model.build_model``, its refusal a ``ConfigError`` (a flag's: exit 2, one sentence)."""
    try:
        return build_model(ref, schema, seed, options)
    except ModelError as exc:
        raise ConfigError(str(exc)) from None


def tried(ref: str, schema: Schema, seed: int, options: Optional[dict[str, Any]], batch: Batch) -> None:
    """Build the model and run it forward over ``batch`` (the data's first lines): a mistake in the
    model file is a ``ConfigError`` saying what, before any member starts."""
    model = built(ref, schema, seed, options)
    try:
        with torch.no_grad():
            out = model(batch)
    except Exception as exc:    # noqa: BLE001 - the user's forward
        raise ConfigError(f"--model {ref}: its forward over {len(batch)} samples of --data raised {said(exc)}") \
            from None
    wanted = tuple(batch.labels.shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != wanted or not out.is_floating_point():
        got = f"a tensor of shape {list(out.shape)} ({out.dtype})" if isinstance(out, torch.Tensor) \
            else f"a {type(out).__name__}"
        raise ConfigError(f"--model {ref}: its forward over {len(batch)} samples gave {got}; it must give a logit a "
                          f"sample, a float tensor of shape [{len(batch)}]")


def schema_model_spec(ref: str, schema: Schema, *, seed: int, optimizer: str, lr: float, table_rule: str,
                      options: Optional[dict[str, Any]] = None, **more: Any) -> ModelSpec:
    """What the servers host for the model ``ref`` over ``schema``: derived from it, with what it
    was built from (which trainers read back, ``hosted_module``) and ``more`` for them to read."""
    return hosted_spec(built(ref, schema, seed, options), optimizer=optimizer, lr=lr, table_rule=table_rule,
                       meta={"model": ref, "schema": schema.model_dump(mode="json"), "seed": seed,
                             "options": options or {}, **more})


def hosted_module(hosted: dict[str, Any]) -> nn.Module:
    """The module the servers host, built here from what they say of it (``PsClient.model``)."""
    return built(hosted["model"], Schema.model_validate(hosted["schema"]), int(hosted["seed"]),
                       hosted.get("options"))


class SchemaModel(HostedModel):
    """A model over a schema in a CTR trainer: its logits over a batch of the schema's files, and their
    binary cross-entropy with the labels."""

    def fetch_for(self, batch: Batch) -> Any:
        return self.fetch(batch.sparse)

    def lookups_for(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.lookups(batch.sparse)

    def loss(self, batch: Batch, fetched: Any) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.run(fetched, batch), batch.labels)

    def predict(self, batch: Batch) -> np.ndarray:
        with torch.no_grad():
            return torch.sigmoid(self.run(self.fetch(batch.sparse), batch)).numpy()
