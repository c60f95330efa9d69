"""A third workload, defined only here, that the parameter servers host: the proof that a
server-hosted workload needs no edit in ``ps/`` or ``services/``.

Registered for a process by ``RPCPS_WORKLOADS=tests.support.tiny:SPEC``. Its model has a row-wise
table stepped by row-wise Adagrad, a one-row table (smaller than the server count, so whole on one
server) stepped by SGD, and a dense tensor stepped by the model's Adagrad. Its client is the test
driver (``tests/support/driver.py tiny``), a member named as the language model's trainers are.
"""
from __future__ import annotations

import torch
from pydantic import Field

from ps.spec.config import PsConfig
from ps.spec.model import DenseGroup, ModelSpec, Table
from services.config import ConfigBase
from services.workload import HostedSpec, WorkloadSpec

DIM = 4


class TinyServerConfig(PsConfig):
    rows: int = Field(50, ge=1, description="rows of the big table")


class TinyUp(ConfigBase):
    """It runs only as roles alone (the test starts them): nothing for `rpcps up`."""


def initial(table: int, ids: torch.Tensor) -> torch.Tensor:
    """Each row a function of its table and id, as any process would build it."""
    return (ids.double()[:, None] * 0.01 + torch.arange(DIM) * 0.1 + table).float()


def model(cfg: TinyServerConfig) -> ModelSpec:
    return ModelSpec({"big": Table(cfg.rows, {"big.weight": (DIM,)}, lambda ids: {"big.weight": initial(0, ids)},
                                   rule="rowwise_adagrad"),
                      "flag": Table(1, {"flag.weight": (DIM,)}, lambda ids: {"flag.weight": initial(1, ids)},
                                    rule="sgd")},
                     (DenseGroup({"w": (DIM,)}, lambda: {"w": torch.linspace(-1.0, 1.0, DIM)}),),
                     optimizer="adagrad", lr=0.1, meta={"tiny": 1, "rows": cfg.rows}, compatible=("rows",))


SPEC = WorkloadSpec(name="tiny", help="a test's own model on the parameter servers", leader="ps0", roles=(),
                    up_settings="tests.support.tiny:TinyUp", launch="tests.support.tiny:TinyUp", checkpoint_dir="tiny",
                    server=HostedSpec("tests.support.tiny:TinyServerConfig", "tests.support.tiny:model",
                                      client_role="trainer"))
