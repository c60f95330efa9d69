"""Building a model from its reference: ``module:Class`` over a schema, as every process (a trainer,
a server deriving what it hosts, ``rpcps.load_model``) builds it alike."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Optional

import torch
import torch.nn as nn

from rpcps.schema import Schema
from rpcps.tables import bags_of


def models_from_here() -> None:
    """Let a model's module be imported from the working folder, as the roles of `rpcps up` (run
    with ``python -m``) import it, when this process was started as the ``rpcps`` script."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


class ModelError(ValueError):
    """A model reference that cannot be built; the message names it and says why."""


def said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def imported(ref: str, flag: str) -> Any:
    """What ``ref`` = ``module:attribute`` names, or a ``ModelError`` (naming ``flag``) saying why
    not. The module is found on the path, the working folder first, in every process alike."""
    models_from_here()
    module_name, _, attribute = ref.partition(":")
    if not module_name or not attribute:
        raise ModelError(f"{flag} {ref}: give it as module:Class")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except ModuleNotFoundError as exc:
        raise ModelError(f"{flag} {ref}: no module {exc.name} (is it installed, or in the working folder or on "
                         f"PYTHONPATH?)") from None
    except AttributeError:
        raise ModelError(f"{flag} {ref}: {module_name} has no {attribute}") from None
    except Exception as exc:    # noqa: BLE001 - a syntax error, or its top level raising: the user's to mend
        raise ModelError(f"{flag} {ref}: importing {module_name} failed: {said(exc)}") from None


def build_model(ref: str, schema: Schema, seed: int, options: Optional[dict[str, Any]] = None) -> nn.Module:
    """``Class(schema, **options)`` for ``ref`` = ``module:Class``, its dense layers drawn from
    ``seed`` (so every process builds the same), or a ``ModelError`` saying what is wrong. The
    module is found on the path, the working folder first, in every process alike."""
    cls = imported(ref, "--model")
    attribute = ref.partition(":")[2]
    torch.manual_seed(seed)
    try:
        model = cls(schema, **(options or {}))
    except Exception as exc:    # noqa: BLE001 - as above
        raise ModelError(f"--model {ref}: {attribute}(schema) raised {said(exc)}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"--model {ref}: {attribute}(schema) gave a {type(model).__name__}, not a torch.nn.Module")
    features = set(schema.features)
    for _, bag in bags_of(model):
        unknown = sorted(set(bag.table_of) - features)
        if unknown:
            raise ModelError(f"--model {ref} looks up feature {', '.join(unknown)}, which the schema does not declare "
                              f"(it declares {', '.join(schema.features)})")
    return model
