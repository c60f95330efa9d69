"""What a workload with hashed tables lets its users set about them: one model of settings for
its servers' and `rpcps up`'s flags, so every such workload words them alike."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from services.config import ConfigBase

if TYPE_CHECKING:
    from ps.spec.model import Lifecycle


class HashedTableSettings(ConfigBase):
    table_capacity: int = Field(0, ge=0, description="a hashed table's rows over every server (0: its size at "
                                                     "--scale, which is also the most it gets)")
    capacity_share: float = Field(1.0, gt=0, le=16, description="a hashed table's rows as a share of its size at "
                                                                "--scale: below 1 bounds it, above 1 leaves room for "
                                                                "ids spread unevenly over the servers (with "
                                                                "--table-capacity: the smaller)")
    admit_after: int = Field(1, ge=1, le=255, description="a hashed table gives an id a row once this many "
                                                          "trainer steps looked it up (1: at once); until then "
                                                          "it reads zeros")
    evict_after_steps: int = Field(0, ge=0, description="a hashed table's rows unseen this many steps go first, "
                                                        "at capacity and at each checkpoint (0: only the least "
                                                        "used go, at capacity)")

    def lifecycle(self) -> "Lifecycle":
        from ps.spec.model import Lifecycle      # torch: not for a command that only parses flags
        return Lifecycle(admit_after=self.admit_after, evict_after_steps=self.evict_after_steps)

    def capacity(self, size: int) -> int:
        """The rows of a hashed table of ``size`` rows at --scale: ``--table-capacity`` and
        ``--capacity-share`` of its size, the smaller, at least 1."""
        share = max(1, math.ceil(size * self.capacity_share))
        return min(self.table_capacity, share) if self.table_capacity else share
