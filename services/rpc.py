"""The only module that starts and stops torch RPC.

The leader (ps0, or the agent in the RL workload) joins as rank 0 and so hosts the rendezvous
store. Everyone else takes a never-used rank from a counter in that store (a reused rank hits stale
pipes), queues a join request, and calls ``init_rpc`` only once the leader has answered (see
``services/membership.py``).
"""
from __future__ import annotations

import datetime
import json
import logging
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.rpc as rpc

from services import membership
from services.errors import JoinRefused
from services.names import leader_of

log = logging.getLogger(__name__)


class RpcEndpoint:
    def __init__(self, name: str, master_addr: str, master_port: int, *, rpc_timeout: float = 60.0,
                 join_timeout: float = 300.0, num_worker_threads: int = 16, transport: str = "uv") -> None:
        self.name = name
        self.leader = leader_of(name)
        self._addr, self._port = master_addr, master_port
        self._rpc_timeout, self._join_timeout = rpc_timeout, join_timeout
        self._threads = num_worker_threads
        self._transport = transport
        self.rank: Optional[int] = None
        self.store: Optional[dist.TCPStore] = None  # plain client of the rendezvous store
        self.joined = False

    @classmethod
    def for_role(cls, cfg: Any) -> "RpcEndpoint":
        """The endpoint a role's configuration (``services.config.CommonConfig``) describes."""
        return cls(cfg.name, cfg.master_addr, cfg.master_port, rpc_timeout=cfg.rpc_timeout,
                   join_timeout=cfg.join_timeout, transport=cfg.rpc_transport)

    def _options(self) -> rpc.TensorPipeRpcBackendOptions:
        # TensorPipe's shared-memory transport busy-polls a core per process; on small hosts that
        # steals the CPU the servers compute on. "uv" (TCP, epoll) costs ~0.3 ms more per call; tensor
        # bytes between local processes still move by the cma channel.
        return rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=self._threads,
            rpc_timeout=self._rpc_timeout,
            init_method=f"tcp://{self._addr}:{self._port}",
            _transports=[self._transport],
        )

    def _client(self) -> dist.TCPStore:
        # A client constructed before the leader is up retries until the timeout, so roles may start in any order.
        return dist.TCPStore(self._addr, self._port, is_master=False,
                             timeout=datetime.timedelta(seconds=self._join_timeout))

    def connect(self) -> dist.TCPStore:
        """The rendezvous store, before joining (a member other than the leader; waits for it)."""
        if self.name == self.leader:
            raise RuntimeError("the leader hosts the store; it has no store before it joins")
        if self.store is None:
            self.store = self._client()
        return self.store

    def join(self) -> None:
        if self.name == self.leader:
            self.rank = 0
            rpc.init_rpc(self.name, rank=0, world_size=None, rpc_backend_options=self._options())
            self.store = self._client()
        else:
            self.connect()
            self.rank = int(self.store.add(membership.RANK_COUNTER, 1))
            if self.rank > membership.MAX_RANK:
                raise JoinRefused(f"no RPC ranks left in this store's life (>{membership.MAX_RANK} joins); restart the leader")
            self.store.queue_push(membership.JOIN_QUEUE, json.dumps({"name": self.name, "rank": self.rank}))
            key = membership.approval_key(self.rank)
            log.info("asking %s to admit %s (rank %d)", self.leader, self.name, self.rank)
            self.store.wait([key], datetime.timedelta(seconds=self._join_timeout))
            membership.check_answer(self.store.get(key).decode(), self.name)
            rpc.init_rpc(self.name, rank=self.rank, world_size=None, rpc_backend_options=self._options())
        self.joined = True
        log.info("joined the RPC group as %s (rank %d) via %s:%d", self.name, self.rank, self._addr, self._port)

    def leave(self) -> None:
        """Leave without blocking on any other member: the leader removes us, then we stop locally."""
        if not self.joined:
            return
        self.joined = False
        if self.name != self.leader:
            membership.request_leave(self.name)
        try:
            rpc.shutdown(graceful=False)
        except Exception as exc:
            log.warning("rpc shutdown: %s", exc)
        log.info("left the RPC group")
