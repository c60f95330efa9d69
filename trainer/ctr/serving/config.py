"""`rpcps serve`'s settings."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field, model_validator

from ps.spec.config import ServersConfig


class ServeSettings(ServersConfig):
    """A serving member: where its model comes from, and how it answers."""

    name: str = Field("serve0", description="RPC name: serve<index>")
    snapshot: Optional[Path] = Field(None, description="an exported model (rpcps export --out DIR): served from "
                                                       "memory, no cluster needed; none: the live servers' model, "
                                                       "read through a cache (online)")
    staleness: float = Field(1.0, gt=0, le=3600, description="online: seconds a row or the dense weights read from "
                                                             "the servers answer before they are read again")
    cache_rows: int = Field(1_000_000, ge=0, description="online: most rows kept (the least recently read go "
                                                         "first)")
    read_timeout: float = Field(5.0, gt=0, description="online: seconds a read from the servers may take (then "
                                                       "503)")
    data: Optional[Path] = Field(None, description="online: the training files, to measure standardized columns "
                                                   "on as the trainers did (a schema without their mean and std)")
    batch_rows: int = Field(256, ge=1, le=65536, description="most rows one forward pass answers: concurrent "
                                                             "requests share a pass up to this (a bigger request "
                                                             "runs alone)")
    batch_wait_ms: float = Field(0.0, ge=0, le=1000, description="milliseconds a pass that is not full waits for "
                                                                 "more requests (0: take what waits; requests "
                                                                 "arriving during a pass still share the next)")
    request_rows: int = Field(1024, ge=1, le=65536, description="most rows one request may hold")
    body_bytes: int = Field(1 << 20, ge=1024, description="most bytes a /predict body may hold (larger: 413)")
    queue_rows: int = Field(8192, ge=1, description="most rows waiting to be answered (more: 503 at once)")
    request_timeout: float = Field(10.0, gt=0, description="seconds a request waits for its answer (then 503)")

    @model_validator(mode="after")
    def _check(self) -> "ServeSettings":
        self._check_role("serve")
        return self

    @property
    def online(self) -> bool:
        return self.snapshot is None
