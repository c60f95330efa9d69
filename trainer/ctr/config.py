"""The CTR workload's settings: its model's, its servers', its trainers', and what `rpcps up
--workload ctr` takes."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ps.spec.config import PsConfig, TablePrecisionSettings
from ps.spec.consistency import Consistency
from ps.spec.hashed_settings import HashedTableSettings
from ps.spec.rules import choices as rule_choices
from services.config import ConfigBase
from trainer.core.config import TrainerSettings, TrainersUpSettings, replicated_rows_need_replica

if TYPE_CHECKING:
    from rpcps.data.builders import Follow
    from rpcps.schema import Schema

TableRule = rule_choices()
DenseRule = rule_choices(tables=False)
Pooling = Literal["sum", "mean"]
Placement = Literal["auto", "row_wise", "table_wise"]

EVAL_FRACTION = 0.05        # --follow: each landing file's share held out, unless --eval-fraction says otherwise
SCALE_HELP = "the tables' rows: Criteo Kaggle's 26 cardinalities (33.8 M rows in all) times this"
DATA_HELP = ("Criteo-format file, or a folder of them (plain or gzip; read in name order), or with --schema "
             "the schema's files (CSV, TSV or Parquet, as its format says); default: generated Criteo-shaped data")
SCHEMA_HELP = "a feature schema (YAML or TOML): the columns of --data and the tables of --model"
MODEL_HELP = ("your model, as module:Class, built as Class(schema) (needs --schema); default: the built-in DLRM, "
              "shaped by the model settings below")
def _loaded(cls: type, path: Optional[Path]) -> Optional[Path]:
    """``--schema`` is read and checked where it is given: a wrong one is a sentence naming the key."""
    if path is not None:
        from rpcps.schema import load_schema
        load_schema(path)           # a SchemaError, a ValueError: pydantic words it as the flag's
    return path


class SchemaSettings(ConfigBase):
    """The schema of the data (``rpcps/schema.py``): the servers derive the tables from it, the
    trainers read the files by it."""

    schema_file: Optional[Path] = Field(None, description=SCHEMA_HELP,
                                        json_schema_extra={"flag": "--schema", "env": "RPCPS_SCHEMA"})
    _schema = field_validator("schema_file")(classmethod(_loaded))

    def loaded_schema(self) -> "Optional[Schema]":
        from rpcps.schema import load_schema
        return load_schema(self.schema_file) if self.schema_file is not None else None


class CtrModelSettings(HashedTableSettings, TablePrecisionSettings, SchemaSettings):
    """What the servers and `rpcps up` say of the built-in model's shape (``trainer/ctr/builtin.py``)
    and rules (with the hashed tables' capacity, admission and eviction, as
    ``ps/spec/hashed_settings.py`` words them, and the tables' precision, as ``ps/spec/config.py``
    does). With ``--model``, the model and its schema say
    its shape instead: only the rules, the learning rate and the seed apply."""

    user_model: str = Field("", description=MODEL_HELP, json_schema_extra={"flag": "--model", "env": "RPCPS_MODEL"})

    scale: float = Field(1.0, gt=0, le=1.0, description=SCALE_HELP)
    dim: int = Field(16, ge=1, le=1024, description="embedding dimension (every table)")
    bottom: str = Field("512,256,64", description="the bottom MLP's hidden sizes over the 13 dense features")
    top: str = Field("512,256", description="the top MLP's hidden sizes over the interaction")
    pooling: Pooling = Field("sum", description="how a bag of ids per feature is pooled")
    table_rule: TableRule = Field("rowwise_adagrad", description="the tables' update rule (rowwise_adagrad: one "
                                                                "state value per row)")
    optimizer: DenseRule = Field("sgd", description="the MLPs' update rule")
    lr: float = Field(0.1, gt=0, description="learning rate (tables and MLPs)")
    placement: Placement = Field("auto", description="where a table's rows go: row_wise (over every server), "
                                                      "table_wise (all on one), auto (row-wise unless smaller than "
                                                      "the server count)")
    seed: int = Field(1111, description="seed of the initial parameters")
    tables: str = Field("modulo", description="how ids find rows: modulo (a value's hash modulo the table's size), "
                                              "hashed (every table keyed by raw 64-bit ids, rows admitted and "
                                              "evicted within a capacity), or the hashed tables' names, as C3,C20")

    _sizes = field_validator("bottom", "top")(classmethod(lambda cls, v: _sizes(v) and v))
    _tables = field_validator("tables")(classmethod(lambda cls, v: _hashed(v) is not None and v))

    @model_validator(mode="after")
    def _model_with_schema(self) -> "CtrModelSettings":
        if self.user_model and self.schema_file is None:
            raise ValueError("--model builds your model from a feature schema: give --schema too")
        if self.user_model and ":" not in self.user_model:
            raise ValueError(f"--model {self.user_model!r}: name your model's class as module:Class")
        if self.user_model:
            shaping = [f for f in DLRM_ONLY if getattr(self, f) != type(self).model_fields[f].default]
            if shaping:
                flags = ", ".join("--" + f.replace("_", "-") for f in shaping)
                raise ValueError(f"{flags} {'shape' if len(shaping) > 1 else 'shapes'} the built-in DLRM; with "
                                 f"--model, the schema says each table's (rows, dim, pooling, hashed, admit_after, "
                                 f"dtype, placement) and your model the rest")
        return self

    def cardinalities(self) -> tuple[int, ...]:
        """The built-in DLRM's tables' sizes: Criteo Kaggle's times ``--scale``."""
        from rpcps.data.generated import SyntheticCtr
        return SyntheticCtr(scale=self.scale).cardinalities

    def hashed_tables(self) -> tuple[int, ...]:
        """The indices of the tables ``--tables`` hashes."""
        return _hashed(self.tables)

    def layers(self) -> dict[str, list[int]]:
        """The MLPs' hidden sizes, as the DLRM takes them."""
        return {"bottom": list(_sizes(self.bottom)), "top": list(_sizes(self.top))}


# The built-in DLRM's shape, which a user's schema says for its own model instead.
DLRM_ONLY = ("scale", "dim", "bottom", "top", "pooling", "placement", "tables", "table_capacity", "capacity_share",
             "admit_after", "evict_after_steps", "table_dtype", "wire_dtype")


def _hashed(tables: str) -> tuple[int, ...]:
    """``--tables``: the indices of the hashed tables."""
    from rpcps.data.criteo import CATEGORICAL
    if tables in ("modulo", "hashed"):
        return tuple(range(CATEGORICAL)) if tables == "hashed" else ()
    names = [n.strip() for n in tables.split(",") if n.strip()]
    known = {f"C{t + 1}": t for t in range(CATEGORICAL)}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{tables!r}: modulo, hashed, or table names among C1 … C{CATEGORICAL}, as C3,C20")
    return tuple(sorted({known[n] for n in names}))


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{text!r}: comma-separated layer sizes, as 512,256") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{text!r}: at least one layer, each of size 1 or more")
    return sizes


class CtrServerConfig(PsConfig, CtrModelSettings):
    """`rpcps ps --workload ctr`: a parameter server hosting the CTR model's tables and MLPs."""


class CtrDataSettings(SchemaSettings):
    """What a CTR trainer reads and how much at a time: `rpcps ctr`'s and `rpcps up`'s alike."""

    data: Optional[Path] = Field(None, description=DATA_HELP)
    batch_size: int = Field(2048, ge=1, le=65536, description="samples per trainer step")
    hot: int = Field(1, ge=1, le=64, description="generated data: ids per categorical feature (a bag; 1: one-hot)")
    data_seed: int = Field(1, description="generated data: which data set (its hidden ground truth and samples)")
    eval_samples: int = Field(16384, ge=0, description="held-out samples every trainer evaluates at an episode's "
                                                       "end (0: none); with --data, the files' first lines, never "
                                                       "trained on (or --eval-data's)")
    eval_data: Optional[Path] = Field(None, description="held-out files, in --data's format, whose first "
                                                        "--eval-samples lines are evaluated instead of --data's: "
                                                        "then every line of --data is trained on")
    source: Optional[str] = Field(None, description="your own source of batches (a message queue, say), as "
                                                    "module:Class, built in each trainer as Class(schema, share, "
                                                    "shares, batch_size) (needs --model and --schema; instead of "
                                                    "--data)")
    follow: bool = Field(False, description="--data is a folder whose files are trained on in name order as they "
                                            "land (written elsewhere and renamed into place), each once; the "
                                            "trainers wait for the next (it may be empty at the start)")
    eval_fraction: Optional[float] = Field(None, ge=0, lt=1, description="--follow: each landing file's first "
                                                                        "records, this share of them, held out and "
                                                                        "never trained on; the evaluation reads those "
                                                                        "of the newest files, up to --eval-samples "
                                                                        "(0: none; default 0.05)")
    clip: float = Field(0.0, ge=0, description="global gradient-norm clip (0: off)")
    prefetch: int = Field(0, ge=0, le=16, description="read the rows of this many batches ahead while a step "
                                                      "computes (async; ssp:K up to K; sync 1, read once the step "
                                                      "before is applied: exact); 0: each step reads its own")
    backward: Optional[Literal["local", "distributed"]] = Field(
        None, description="where a step's backward runs: local (plain autograd on the trainer; each server gets its "
                          "gradients with the update, one message a step) or distributed (torch's distributed "
                          "autograd). Default: local, or distributed with a hashed table")
    cache_rows: int = Field(0, ge=0, le=100_000_000, description="keep copies of up to this many rows of each table "
                                                                 "on the trainer, the most recently used (0: none; "
                                                                 "hashed tables are never cached)")
    cache_share: float = Field(0.0, ge=0, le=1, description="keep copies of up to this share of each table's rows "
                                                            "on the trainer (with --cache-rows: whichever is more, "
                                                            "table by table; 0: --cache-rows alone)")
    cache_staleness: int = Field(1, ge=0, le=1_000_000, description="--cache-rows, --cache-share: a copy serves "
                                                                    "steps up to this many of the trainer's steps "
                                                                    "after the one that read it, then is read again "
                                                                    "(async, ssp); 0: the hot rows replicated "
                                                                    "among the trainers and stepped by them, "
                                                                    "exact (sync with --dense allreduce)")

    @model_validator(mode="after")
    def _one_source(self) -> "CtrDataSettings":
        if self.data is not None and self.hot > 1:
            raise ValueError("--hot shapes generated data; Criteo files have one value per feature")
        if self.schema_file is not None and self.data is None and self.source is None:
            raise ValueError("--schema describes data files: give --data (or --source) too")
        if self.eval_data is not None and self.data is None:
            raise ValueError("--eval-data holds lines out of data files: give --data too (generated data holds out "
                             "its own)")
        if self.source is not None:
            given = [flag for flag, on in (("--data", self.data is not None), ("--follow", self.follow),
                                           ("--eval-data", self.eval_data is not None)) if on]
            if given:
                raise ValueError(f"--source is where the batches come from: leave out {', '.join(given)}")
            if self.schema_file is None:
                raise ValueError("--source reads records by a schema: give --model and --schema")
        if self.follow:
            if self.data is None or not self.data.is_dir():
                raise ValueError(f"--follow watches a folder for files landing: --data {self.data or ''} is "
                                 f"{'not given' if self.data is None else 'not a folder'}")
            if self.prefetch:
                raise ValueError("--follow trains on a batch as soon as it lands; --prefetch would hold it until the "
                                 "next file: leave it out")
        elif self.eval_fraction is not None:
            raise ValueError("--eval-fraction holds out a share of each landing file, with --follow; without it, "
                             "--eval-samples holds out the data's first lines")
        from rpcps.data.files import checked_data      # the readers, loaded where data is given
        checked_data(self.data, self.loaded_schema(), follow=self.follow)
        checked_data(self.eval_data, self.loaded_schema())
        return self

    @property
    def held_in_data(self) -> int:
        """The lines of --data held out for evaluation: its first --eval-samples, unless --eval-data
        (or --follow, which holds out a share of each file)."""
        return 0 if self.eval_data is not None or self.follow else self.eval_samples

    def followed(self) -> "Optional[Follow]":
        """How --follow reads --data, or None without it."""
        if not self.follow:
            return None
        from rpcps.data.builders import Follow
        fraction = EVAL_FRACTION if self.eval_fraction is None else self.eval_fraction
        return Follow(fraction if self.eval_samples and self.eval_data is None else 0.0)


# The data settings come first: their clip (0, DLRM's) wins over every trainer's (0.25).
class CtrTrainerConfig(CtrDataSettings, TrainerSettings):
    """`rpcps ctr`: a click-through-rate trainer."""

    name: str = Field("ctr0", description="RPC name: ctr<index>")
    eval_batch_size: int = Field(4096, ge=1, le=65536, description="samples per evaluation batch")

    @model_validator(mode="after")
    def _check(self) -> "CtrTrainerConfig":
        self._check_role("ctr")
        _follow_without_allreduce(self.follow, self.dense)
        replicated_rows_need_replica(bool(self.cache_rows or self.cache_share), self.cache_staleness, self.dense)
        return self


class CtrUpSettings(CtrDataSettings, TrainersUpSettings, CtrModelSettings):
    """`rpcps up --workload ctr`: the servers' and trainers' settings a local cluster starts with."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        **TrainersUpSettings.flag_groups, "cluster": (*TrainersUpSettings.flag_groups["cluster"], "serve",
                                                      "serve_staleness")}

    serve: int = Field(0, ge=0, le=8, description="serving members (serve0, …) answering POST /predict from the "
                                                  "live servers, started with the cluster")
    serve_staleness: float = Field(1.0, gt=0, le=3600, description="seconds a row or the dense weights a serving "
                                                                   "member read answer before it reads them again")

    @model_validator(mode="after")
    def _prefetch_within_consistency(self) -> "CtrUpSettings":
        _follow_without_allreduce(self.follow, self.dense_at)
        cached = self.cache_rows or self.cache_share
        Consistency.parse(self.consistency).check_reads(self.prefetch, self.cache_staleness if cached else 0)
        replicated_rows_need_replica(bool(cached), self.cache_staleness, self.dense_at)
        if self.backward == "local" and self.hashed_tables():
            raise ValueError(f"--backward local with --tables {self.tables}: a hashed table's reads are recorded in "
                             f"the step's distributed autograd context (ids admitted, rows changing hands); leave "
                             f"--backward out, or give --backward distributed")
        return self


def _follow_without_allreduce(follow: bool, dense: Optional[str]) -> None:
    if follow and dense == "allreduce":
        raise ValueError("--follow with --dense allreduce: a trainer waiting for the next file would hold every "
                         "other trainer's all-reduce; use --dense ps")
