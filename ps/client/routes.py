"""Where a trainer's requests go under one of the leader's layouts (``Routes``): the servers in
order, each table's plan, the servers that hold dense tensors, and the epoch every request carries.

A client holds one and replaces it whole when the leader's layout changes
(``PsClient.follow_layout``), so a read planned with it, and the requests that carry it out, see
one layout even while another thread follows a new one. The parts of a step that plan (the reads,
the cache's copies, the gradients sent again after a move, ``ps/client/fetching.py``) are handed
the routes they plan by, never the client.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Collection, Mapping, Optional

import torch

from ps.client.lookups import LookupPlan, plan_lookups
from ps.spec.sharding import HashedPlan, Plan, Slots, client_plans


@dataclass(frozen=True)
class Routes:
    slots: Slots
    plans: dict[str, Plan]            # table -> how its rows spread over the servers
    table_of: dict[str, str]          # table parameter -> its table
    max_ids: int                      # the most ids one request may name
    placed: dict[str, tuple[str, int]]    # what the servers said of each table's placement: the plans' input
    ids: dict[str, int]                   # each table's ids

    @classmethod
    def of(cls, slots: Slots, placed: dict[str, tuple[str, int]], ids: dict[str, int], table_of: dict[str, str],
           max_ids: int) -> "Routes":
        return cls(slots, client_plans(slots, placed, ids), table_of, max_ids, placed, ids)

    def following(self, slots: Slots) -> "Routes":
        """These routes under the layout ``slots``."""
        return replace(self, slots=slots, plans=client_plans(slots, self.placed, self.ids))

    @property
    def epoch(self) -> int:
        return self.slots.epoch

    @functools.cached_property
    def servers(self) -> list[str]:
        """The servers, the leader first: a plan's shard ``k`` is ``servers[k]``."""
        return list(self.slots.servers)

    @functools.cached_property
    def dense_shards(self) -> list[int]:
        """The shards that hold dense tensors."""
        return self.slots.dense_homes()

    def plan(self, lookups: Mapping[str, torch.Tensor], row_shapes: Optional[Mapping[str, tuple[int, ...]]] = None,
             distinct: Collection[str] = ()) -> LookupPlan:
        """``lookups`` (parameter -> ids) as requests to these servers (``plan_lookups``)."""
        return plan_lookups(lookups, self.plans, self.table_of, self.max_ids, row_shapes, distinct)

    def pushable(self, lookups: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``lookups`` cut in two: those whose gradients a step may push, so it may read them before
        it begins or take them from the cache, and those it must read in its own context: a
        hashed table's, whose reading admits ids and whose rows change hands."""
        early = {p: ids for p, ids in lookups.items() if not isinstance(self.plans[self.table_of[p]], HashedPlan)}
        return early, {p: ids for p, ids in lookups.items() if p not in early}
