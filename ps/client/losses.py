"""Servers a trainer can no longer count on: which went away (gone from the group, back under a new
rank, or silent to a probe), what a step's failure means (``failed``: the step ended at the clock,
``ServerLost`` for the caller), and which have come back (``returned``). Every server's answer
about itself is checked against the first one's (``check_server``), at the start and on return."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

from ps.client.routes import Routes
from ps.spec.messages import ShardInfo
from ps.spec.surface import PsSurface
from services.errors import PeerUnavailable, ServerLost, StepLost, UpdateRefused
from services.membership import member_ranks, probe
from services.remote import call_async, wait

if TYPE_CHECKING:
    from ps.client.step_end import Replica

log = logging.getLogger(__name__)

PROBE_SECONDS = 2.0    # a server that does not answer a no-op within this is counted lost
FORGET_SECONDS = 15.0  # the leader evicts a dead member within about 3 s (two missed probes)


def check_server(ps_names: list[str], k: int, info: ShardInfo, first: ShardInfo, epoch: int) -> None:
    """``info``, the answer of server ``k`` of ``ps_names``, against the first server's and the
    layout ``epoch`` the client plans by: ``PeerUnavailable`` saying what differs."""
    name = ps_names[k]
    if info.shard != k or info.num_shards != len(ps_names):
        raise PeerUnavailable(f"{name} serves shard {info.shard} of {info.num_shards}, "
                              f"expected shard {k} of {len(ps_names)}: check --num-ps everywhere")
    if info.epoch != epoch:
        raise PeerUnavailable(f"{name} serves by layout {info.epoch}, the leader's is {epoch}: it started "
                              f"before the leader's layout changed; start it again")
    shapes = getattr(info, "row_shapes", None)      # an older server's answer has none
    if shapes is None or set(shapes) != {p for params in info.table_params.values() for p in params}:
        raise PeerUnavailable(f"{name} does not say the shapes of its rows: it runs an older rpcps than "
                              "this trainer; run one version on every member")
    if info.model != first.model:
        raise PeerUnavailable(f"{name} hosts a different model than {ps_names[0]}")
    if info.consistency != first.consistency:
        raise PeerUnavailable(f"{name} runs consistency {info.consistency}, {ps_names[0]} "
                              f"{first.consistency}: start every server with the same --consistency")


class ServerLosses:
    """A trainer's servers (those of its ``routes`` now), each known under the rank it had when
    this trainer last counted on it (a server's rank changes when it restarts); ``first``: what
    every server, and one back from a restart, must agree with; ``lose_step``: the step under
    way ended without its update (``StepClock.lose_step``, the cache's copies dropped with it)."""

    def __init__(self, routes: Callable[[], Routes], leader: str, first: ShardInfo,
                 lose_step: Callable[[BaseException, Optional["Replica"]], StepLost]) -> None:
        self._routes, self._leader, self._first, self._lose_step = routes, leader, first, lose_step
        ranks = member_ranks()
        self._ranks = {n: ranks.get(n) for n in routes().servers}

    def track(self, names: list[str]) -> None:
        """The servers of a new layout: one that joined is counted on under its rank now."""
        ranks = member_ranks()
        self._ranks = {n: self._ranks[n] if n in self._ranks else ranks.get(n) for n in names}

    def failed(self, why: BaseException, replica: Optional["Replica"] = None) -> Optional[ServerLost]:
        """What a step's failure ``why`` means. ``ServerLost``, the step ended as ``lose_step``
        ends it, when servers other than the leader went away; None when it is not this client's
        to explain (a refusal, a step already lost, the leader gone, a bug): the caller raises it."""
        if isinstance(why, (UpdateRefused, StepLost)):
            return None
        lost = self.lost()
        if not lost or self._leader in lost:
            return None
        self._lose_step(why, replica)
        self._until_forgotten(lost)
        return ServerLost(f"{', '.join(lost)} went away, and this step was lost ({str(why).splitlines()[0]})",
                          tuple(lost))

    def _until_forgotten(self, lost: list[str]) -> None:
        """Wait, at most ``FORGET_SECONDS``, until this process no longer knows ``lost`` under
        the ranks it had (the leader evicts a dead member within seconds). Called inside the
        failed step's autograd context, so that its release, which tells every server of the
        context, finds the dead one unknown: torch 2.13 releasing it while the eviction removes
        that member reads freed memory (``std::bad_alloc`` in the log, then aborts)."""
        deadline = time.monotonic() + FORGET_SECONDS
        while time.monotonic() < deadline:
            ranks = member_ranks()
            if all(ranks.get(n) != self._ranks[n] for n in lost):
                return
            time.sleep(0.05)  # noqa: sleep-ok (polling this process's member list, bounded)
        log.warning("%s still known to this process after %.0fs", ", ".join(lost), FORGET_SECONDS)

    def lost(self) -> list[str]:
        """The servers this client can no longer count on: gone from the group, back under a new
        rank (restarted, so what a step had begun with it is gone), or silent to a probe."""
        ranks = member_ranks()
        names = self._routes().servers
        present = [n for n in names if ranks.get(n) == self._ranks[n]]
        answered = probe(present, timeout=PROBE_SECONDS)
        return [n for n in names if not answered.get(n, False)]

    def returned(self, names: list[str]) -> list[str]:
        """Of ``names``, the servers serving again: in the group and answering as the same shard
        of the same model (``PeerUnavailable`` if one came back as another). Each one's new rank
        is remembered."""
        ranks = member_ranks()
        routes = self._routes()
        ps_names = routes.servers
        back = []
        for name in [n for n in names if n in ranks]:
            try:
                info: ShardInfo = wait(call_async(name, PsSurface.info, timeout=PROBE_SECONDS))
            except Exception:  # noqa: BLE001 - joining, restoring its shard, or gone again: not yet
                continue
            check_server(ps_names, ps_names.index(name), info, self._first, routes.epoch)
            self._ranks[name] = ranks[name]
            back.append(name)
        return back
