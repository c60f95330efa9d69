"""The only module that starts and stops torch RPC.

The leader (ps0, or the agent in the RL workload) joins as rank 0 and hosts the rendezvous store.
Everyone else takes a never-used rank from a counter in that store (a reused rank hits stale
pipes), queues a join request, and calls ``init_rpc`` only once the leader has answered (see
``services/membership.py``).

The store executes what it is sent, so it listens on one address only: torch's own ``tcp://``
rendezvous would listen on every interface. ``init_rpc`` is handed the store this module made,
through a rendezvous scheme of its own (``rpcps://<name>``).
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import threading
import uuid
from typing import Any, Callable, Iterator, Optional, TypeVar
from urllib.parse import urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc

from services import membership
from services.config import LeaderConfig
from services.errors import JoinRefused
from services.leader import LEADER_KEY, PROBE_TIMEOUT
from services.names import leader_of

log = logging.getLogger(__name__)

T = TypeVar("T")
SHUTDOWN_SECONDS = 3.0   # torch RPC's local shutdown takes milliseconds; a stop must stay bounded
_SCHEME = "rpcps"
# TensorPipe's channels by ``--rpc-channel``, best first: cma copies between processes of one
# machine; across hosts, basic sends on the message's own connection, while TensorPipe's default
# adds mpt_uv: 16 more loop threads in every process and 16 more connections to each peer, whose
# loops cost a trainer on a host of 0.25 cores several times basic's (`rpcps bench scale`).
CHANNELS = {"basic": ("cma", "basic"), "multiplexed": ("cma", "mpt_uv", "basic")}
_lent: dict[str, dist.Store] = {}    # name -> the store its init_rpc is to use
_lent_lock = threading.Lock()


def _rendezvous(url: str, **_: Any) -> Iterator[tuple[dist.Store, int, int]]:
    parsed = urlparse(url)
    with _lent_lock:
        store = _lent.pop(parsed.netloc)
    query = dict(part.split("=", 1) for part in parsed.query.split("&") if "=" in part)
    yield store, int(query.get("rank", -1)), int(query.get("world_size", -1))


dist.register_rendezvous_handler(_SCHEME, _rendezvous)


def store_address(master_addr: str) -> str:
    """Where the leader's store listens by default: the address ``master_addr`` names, when it is
    one of this host's (127.0.0.1 locally; the container's own address in compose), else every
    interface (a name for a load-balanced service, which no process can bind)."""
    try:
        address = socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return address
    except OSError:
        log.warning("%s is not an address of this host: the rendezvous store listens on every interface "
                    "(--store-host chooses one)", master_addr)
        return "0.0.0.0"


def _keep_local(master_addr: str) -> None:
    """A cluster whose leader is on loopback keeps TensorPipe's and Gloo's listeners there too: left
    alone, they listen on the address the host's name resolves to, which may face a network."""
    if "TP_SOCKET_IFNAME" in os.environ:
        return
    try:
        local = ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback
    except (OSError, ValueError):
        return
    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if local and loopback:
        os.environ["TP_SOCKET_IFNAME"] = loopback[0]   # read by TensorPipe when the agent starts
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])   # and by Gloo (the trainers' group)


class RpcEndpoint:
    def __init__(self, name: str, master_addr: str, master_port: int, *, rpc_timeout: float = 60.0,
                 join_timeout: float = 300.0, num_worker_threads: int = 16, transport: str = "uv",
                 channel: str = "basic", store_host: Optional[str] = None) -> None:
        self.name = name
        self._store_host = store_host
        self._listener: Optional[socket.socket] = None   # the leader's store's socket, kept open
        self.leader = leader_of(name)
        self._addr, self._port = master_addr, master_port
        self._rpc_timeout, self._join_timeout = rpc_timeout, join_timeout
        self._threads = num_worker_threads
        self._transport = transport
        self._channels = CHANNELS[channel]
        self.rank: Optional[int] = None
        self.store: Optional[dist.TCPStore] = None  # plain client of the rendezvous store
        self.joined = False

    @classmethod
    def for_role(cls, cfg: Any) -> "RpcEndpoint":
        """The endpoint a role's configuration (``services.config.CommonConfig``) describes."""
        return cls(cfg.name, cfg.master_addr, cfg.master_port, rpc_timeout=cfg.rpc_timeout,
                   join_timeout=cfg.join_timeout, transport=cfg.rpc_transport, channel=cfg.rpc_channel,
                   store_host=cfg.store_host if isinstance(cfg, LeaderConfig) else None)

    def _options(self) -> rpc.TensorPipeRpcBackendOptions:
        # TensorPipe's shared-memory transport busy-polls a core per process; on small hosts that
        # steals the CPU the servers compute on. "uv" (TCP, epoll) costs ~0.3 ms more per call; tensor
        # bytes between local processes still move by the cma channel.
        return rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=self._threads,
            rpc_timeout=self._rpc_timeout,
            init_method=f"{_SCHEME}://{self.name}",
            _transports=[self._transport],
            _channels=list(self._channels),
        )

    def _client(self, timeout: Optional[float] = None) -> dist.TCPStore:
        # A client constructed before the leader is up retries until the timeout, so roles may start in any order.
        return dist.TCPStore(self._addr, self._port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout or self._join_timeout))

    def prefixed_store(self, prefix: str, timeout: float) -> dist.Store:
        """A client of the leader's store of its own, its keys under ``prefix``: a rendezvous of
        some members besides RPC's (the trainers' process group), with no port of its own."""
        return dist.PrefixStore(prefix, self._client(timeout))

    def reader(self, key: str = LEADER_KEY) -> Callable[[], str]:
        """A function reading ``key`` from the store on a client of its own, which gives up after
        a short timeout (a fresh client after any failure), so a hung leader cannot block its
        caller. The default key reads the id of the leader whose store answers
        (``services.leader.LeaderWatch``'s probe)."""
        return self._probing(lambda client: client.get(key).decode())

    def evicted(self) -> Callable[[], bool]:
        """A function telling, on a client of its own as ``reader``'s, whether the leader has
        evicted this member (after it missed its liveness probes)."""
        return self._probing(lambda client: self.rank is not None
                             and client.check([membership.evicted_key(self.rank)]))

    def _probing(self, ask: Callable[[dist.TCPStore], T]) -> Callable[[], T]:
        client: Optional[dist.TCPStore] = None
        asking: Optional[threading.Thread] = None

        def once(answer: list[Any]) -> None:
            nonlocal client
            try:
                if client is None:
                    # A store client retries a refused connection until its timeout; a plain
                    # connect tells at once that nothing listens (a dead leader on a live host).
                    socket.create_connection((self._addr, self._port), timeout=PROBE_TIMEOUT).close()
                    client = self._client(PROBE_TIMEOUT)
                answer.append((True, ask(client)))
            except Exception as exc:  # noqa: BLE001 - handed to the prober, which raises it
                client = None
                answer.append((False, exc))

        def probe() -> T:
            # A store client's get outlives its timeout when the leader's host is cut off (it
            # waits for the cancelled wait's answer, which never comes): the ask runs in a thread
            # of its own, given PROBE_TIMEOUT and a second, and a stuck one is left to end by itself.
            nonlocal asking, client
            if asking is not None and asking.is_alive():
                raise TimeoutError("the leader's store has not answered the previous probe")
            answer: list[Any] = []          # this probe's own: a stuck one's late answer lands in its own
            asking = threading.Thread(target=once, args=(answer,), name="leader-probe", daemon=True)
            asking.start()
            asking.join(PROBE_TIMEOUT + 1.0)
            if not answer:
                client = None           # the stuck thread keeps its own; the next probe connects anew
                raise TimeoutError(f"the leader's store did not answer within {PROBE_TIMEOUT + 1.0:g}s")
            ok, value = answer[0]
            if not ok:
                raise value
            return value
        return probe

    def _serve_store(self) -> dist.TCPStore:
        host = self._store_host or store_address(self._addr)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self._port))
        except OSError as exc:
            sock.close()
            raise JoinRefused(f"the rendezvous store cannot listen on {host}:{self._port}: {exc.strerror}") from None
        sock.listen(2048)
        self._listener = sock
        log.info("rendezvous store listening on %s:%d", host, self._port)
        return dist.TCPStore(self._addr, self._port, is_master=True, master_listen_fd=sock.fileno(),
                             wait_for_workers=False, timeout=datetime.timedelta(seconds=self._join_timeout))

    def _init_rpc(self, store: dist.Store) -> None:
        _keep_local(self._addr)
        with _lent_lock:
            _lent[self.name] = store
        rpc.init_rpc(self.name, rank=self.rank, world_size=None, rpc_backend_options=self._options())

    def connect(self) -> dist.TCPStore:
        """The rendezvous store, before joining (a member other than the leader; waits for it)."""
        if self.name == self.leader:
            raise RuntimeError("the leader hosts the store; it has no store before it joins")
        if self.store is None:
            self.store = self._client()
        return self.store

    def join(self, note: Optional[dict] = None) -> dict:
        """Join the group; the leader's reply to ``note`` (``Membership.on_join``; {} for the leader)."""
        reply: dict = {}
        if self.name == self.leader:
            self.rank = 0
            self._init_rpc(self._serve_store())
            self.store = self._client()
            self.store.set(LEADER_KEY, uuid.uuid4().hex[:12])   # before anyone is admitted
        else:
            self.connect()
            self.rank = int(self.store.add(membership.RANK_COUNTER, 1))
            if self.rank > membership.MAX_RANK:
                raise JoinRefused(f"no RPC ranks left in this store's life (>{membership.MAX_RANK} joins); restart the leader")
            self.store.queue_push(membership.JOIN_QUEUE, json.dumps({"name": self.name, "rank": self.rank,
                                                                    "note": note or {}}))
            key = membership.approval_key(self.rank)
            log.info("asking %s to admit %s (rank %d)", self.leader, self.name, self.rank)
            self.store.wait([key], datetime.timedelta(seconds=self._join_timeout))
            reply = membership.check_answer(self.store.get(key).decode(), self.name)
            self._init_rpc(self._client())
        self.joined = True
        log.info("joined the RPC group as %s (rank %d) via %s:%d", self.name, self.rank, self._addr, self._port)
        return reply

    def leave(self) -> None:
        """Leave without blocking on any other member: the leader removes us, then we stop locally."""
        if not self.joined:
            return
        self.joined = False
        if self.name != self.leader:
            membership.request_leave(self.name)
        done = threading.Event()

        def shut_down() -> None:
            try:
                rpc.shutdown(graceful=False)
            except Exception as exc:  # noqa: BLE001 - leaving goes on
                log.warning("rpc shutdown: %s", exc)
            finally:
                done.set()
        # torch 2.13's agent can hang in its shutdown once it failed to release a distributed
        # autograd context on a member that died (seen after a server was lost twice, with
        # "Could not release Dist Autograd Context ... std::bad_alloc"): leaving stays bounded.
        threading.Thread(target=shut_down, name="rpc-shutdown", daemon=True).start()
        if done.wait(SHUTDOWN_SECONDS):
            log.info("left the RPC group")
        else:
            log.warning("left the RPC group without torch RPC's local shutdown, still running after %.0fs",
                        SHUTDOWN_SECONDS)
