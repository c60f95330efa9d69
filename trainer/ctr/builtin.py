"""The built-in CTR model: the DLRM of ``trainer/ctr/dlrm.py`` (a model file of the kind a user
writes, over the public API) on Criteo's format, which is a schema like any user's. `rpcps up
--workload ctr`'s model flags shape both: ``--scale`` the tables' rows, ``--tables`` which are
hashed, ``--dim``, ``--pooling``, the precisions and placement each table's, ``--bottom`` and
``--top`` the MLPs. The servers host it as they host a user's model (``trainer/ctr/custom.py``);
its trainers read generated data or Criteo files, as batches of the schema's features."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rpcps.data.generated import CATEGORICAL, DENSE

if TYPE_CHECKING:
    from rpcps.schema import Schema
    from trainer.ctr.config import CtrModelSettings

MODEL = "trainer.ctr.dlrm:DLRM"


def criteo_schema(s: "CtrModelSettings") -> "Schema":
    """Criteo's tab-separated lines (a label, 13 counts, 26 categorical values) as a schema: the
    counts clipped at 0 and ``log1p``'d, each categorical column looked up in a table of its own."""
    from rpcps.schema import Categorical, Numeric, Schema
    from rpcps.tables import TableConfig
    counts, values = [f"I{i + 1}" for i in range(DENSE)], [f"C{t + 1}" for t in range(CATEGORICAL)]
    hashed = s.hashed_tables()
    tables = [TableConfig(name=name, rows=s.capacity(rows) if t in hashed else rows, dim=s.dim, pooling=s.pooling,
                          hashed=t in hashed, admit_after=s.admit_after, evict_after_steps=s.evict_after_steps,
                          dtype=s.table_dtype, wire_dtype=s.wire_dtype, placement=s.placement)
              for t, (name, rows) in enumerate(zip(values, s.cardinalities()))]
    return Schema(format="tsv", header=False, columns=("label", *counts, *values), label="label",
                  numeric=tuple(Numeric(column=c, clip=(0, None), log1p=True) for c in counts),
                  categorical=tuple(Categorical(column=c) for c in values), tables=tuple(tables))


def named(s: "CtrModelSettings") -> tuple[str, "Schema", dict[str, Any], dict[str, Any]]:
    """The model the settings name, as every process builds it: a user's (``--model`` over
    ``--schema``) or this DLRM over Criteo's schema. (Its import path, its schema, its arguments,
    and what else its trainers must know: for the DLRM, the tables' sizes at ``--scale``, which
    generated ids fill and a Criteo value is reduced modulo, and which tables take raw ids.)"""
    if s.user_model:
        return s.user_model, s.loaded_schema(), {}, {}
    return MODEL, criteo_schema(s), s.layers(), {"criteo": {"cardinalities": list(s.cardinalities()),
                                                            "hashed": list(s.hashed_tables())}}
