"""The parameter servers' settings, and the names of a cluster's servers. What model they host is
the workload's: its server role adds the model's settings to ``PsConfig``."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ps.spec.consistency import checked
from ps.spec.counting import check_mode
from services.config import CommonConfig, ConfigBase, LeaderConfig, RestoringConfig
from services.names import format_name, parse_name
from services.workload import hosted


Dtype = Literal["fp32", "fp16", "bf16"]       # ``ps/spec/precision.py``'s
FULL_EVERY_HELP = ("every Nth checkpoint is whole; the ones between are deltas, holding only the rows changed "
                   "since the checkpoint before (1: every one whole)")


class TablePrecisionSettings(ConfigBase):
    """How a workload's tables are stored and sent, for its servers' and `rpcps up`'s flags: one
    model, so every workload that offers them words them alike."""

    table_dtype: Dtype = Field("fp32", description="how the tables' rows are stored on the servers: fp32, or fp16 "
                                                    "or bf16 (half the bytes; updated in fp32 and rounded "
                                                    "stochastically; optimizer state stays fp32)")
    wire_dtype: Dtype = Field("fp32", description="how looked-up rows and their gradients cross the wire: fp32, "
                                                   "or fp16 or bf16 (half the bytes)")


def ps_names(num_ps: int) -> list[str]:
    return [format_name("ps", i) for i in range(num_ps)]


class ServersConfig(CommonConfig):
    """A role of a cluster of parameter servers (the servers themselves and their clients)."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {"cluster": ("num_ps",)}

    num_ps: int = Field(2, ge=1, le=64, description="number of parameter servers (shards) in the cluster")


class PsConfig(ServersConfig, RestoringConfig, LeaderConfig):
    """`rpcps ps`: a parameter server; the workload it hosts adds its model's settings."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("workload",),
        "checkpoints": ("checkpoint_every_steps", "checkpoint_every_seconds", "full_checkpoint_every"),
        "failures": ("max_ids_per_request",), "consistency": ("consistency", "count_updates")}
    name: str = Field("ps0", description="RPC name: ps<index>; one past --num-ps joins a running job holding "
                                         "nothing until the leader moves slots to it (rpcps scale)")
    workload: Optional[str] = Field(None, description="the workload whose model this server hosts (default: the first "
                                                      "registered one the servers host); every server the same")
    checkpoint_every_steps: Optional[int] = Field(None, ge=1, description="take a checkpoint every N cluster steps (ps0)")
    checkpoint_every_seconds: Optional[float] = Field(None, gt=0, description="take a checkpoint every M seconds (ps0)")
    full_checkpoint_every: int = Field(1, ge=1, description=FULL_EVERY_HELP)
    max_ids_per_request: int = Field(65_536, ge=1, description="ids one lookup or operation may name; a request "
                                                                  "past it is refused (a bound on what one caller "
                                                                  "can make a server allocate)")
    consistency: str = Field("async", description="how updates are applied: async, sync (averaged, in lockstep), "
                                                  "hybrid (tables async, dense weights all-reduced among the "
                                                  "trainers in lockstep) or ssp:K (no trainer more than K steps "
                                                  "ahead); every server the same")

    count_updates: bool = Field(False, description="count, beside each row, the updates that changed it, and answer "
                                                   "GET /counts with them by slot (trainers count the steps the "
                                                   "servers acknowledged): that no update is lost or applied twice "
                                                   "can be shown in async mode; every server the same")

    _consistency = field_validator("consistency")(classmethod(lambda cls, v: checked(v)))

    @model_validator(mode="after")
    def _check(self) -> "PsConfig":
        self._check_role("ps")
        if self.count_updates:
            check_mode(self.consistency)
        try:
            hosted(self.workload)
        except KeyError as exc:
            raise ValueError(f"--workload: {exc.args[0]}") from None
        # The servers a job starts on are the leader's --num-ps; a server past them is one that joins
        # a running job (the layout is the leader's), so that an engine scaling a service or a
        # StatefulSet up can start it with the same settings as the others.
        return self
