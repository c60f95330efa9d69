"""A model written once with the public API (``rpcps``), defined only here: hosted by the servers
through ``RPCPS_WORKLOADS=tests.support.bagged:SPEC`` and trained in one process by the same code.

Its tables: ``item``, shared by a one-id feature and a multi-hot ``history`` averaged over its
ids, stepped by row-wise Adagrad; ``genre``, multi-hot lists summed, stepped by SGD; ``user``, a
hashed table keyed by raw 64-bit ids. Its dense layers are stepped by Adagrad.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import rpcps
from ps.spec.config import PsConfig
from services.config import ConfigBase
from services.workload import HostedSpec, WorkloadSpec
from trainer.core.hosted import hosted_spec

DIM, NUMERIC, LR, OPTIMIZER, SEED = 4, 3, 0.1, "adagrad", 11
TABLES = (rpcps.TableConfig(name="item", rows=40, dim=DIM, features=("item", "history"), pooling="mean",
                            rule="rowwise_adagrad"),
          rpcps.TableConfig(name="genre", rows=7, dim=DIM, rule="sgd"),
          rpcps.TableConfig(name="user", rows=64, dim=DIM, hashed=True))
FEATURES = ("item", "history", "genre", "user")


class BaggedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = rpcps.EmbeddingBags(TABLES, seed=SEED)
        self.bottom = nn.Linear(NUMERIC, DIM)
        self.top = nn.Sequential(nn.Linear(DIM * (1 + len(FEATURES)), 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: rpcps.Batch) -> torch.Tensor:
        pooled = self.tables(batch.sparse)
        x = torch.relu(self.bottom(batch.dense))
        return self.top(torch.cat([x, *(pooled[f] for f in FEATURES)], dim=1)).squeeze(1)


def build() -> BaggedModel:
    torch.manual_seed(SEED)          # every process builds the same dense layers
    return BaggedModel()


def batch(step: int, size: int) -> rpcps.Batch:
    """Step ``step``'s samples: some histories and genre lists empty, user ids anywhere in 64 bits."""
    g = torch.Generator().manual_seed(1000 + step)

    def lists(rows: int, longest: int) -> rpcps.Jagged:
        lengths = torch.randint(0, longest + 1, (size,), generator=g)
        return rpcps.Jagged.of(torch.randint(0, rows, (int(n),), generator=g).tolist() for n in lengths)
    users = torch.randint(-2 ** 62, 2 ** 62, (12,), generator=g)     # 12 users, each in several samples
    return rpcps.Batch({"item": rpcps.Jagged.of([[i] for i in torch.randint(0, 40, (size,), generator=g).tolist()]),
                        "history": lists(40, 5), "genre": lists(7, 3),
                        "user": rpcps.Jagged.of([[int(users[i])] for i in torch.randint(0, 12, (size,), generator=g)])},
                       torch.randn(size, NUMERIC, generator=g), torch.randint(0, 2, (size,), generator=g).float())


class BaggedServerConfig(PsConfig):
    pass


class BaggedUp(ConfigBase):
    """It runs only as roles alone (the test starts them): nothing for `rpcps up`."""


def model(cfg: BaggedServerConfig):
    return hosted_spec(build(), optimizer=OPTIMIZER, lr=LR, meta={"bagged": 1})


SPEC = WorkloadSpec(name="bagged", help="a test's model written with the public API", leader="ps0", roles=(),
                    up_settings="tests.support.bagged:BaggedUp", launch="tests.support.bagged:BaggedUp",
                    checkpoint_dir="bagged",
                    server=HostedSpec("tests.support.bagged:BaggedServerConfig", "tests.support.bagged:model",
                                      client_role="trainer"))
