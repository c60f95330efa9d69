"""The hosts of a compose network (for tests; needs root): ``supervise/hosts/network.py``'s hosts,
with what compose adds. Names resolve as compose's embedded DNS resolves them: a DNS server
(dnslib, in this process) answers each host's name with its address, and every host's
``/etc/resolv.conf`` points at it (the network's files in ``/etc/netns/<namespace>/`` are mounted
over ``/etc`` on each host). The test's own namespace is on the bridge too, as the docker host is,
so it reaches the hosts directly. A host *outside* the cluster (``add_outside``) is a machine on
the docker host's LAN: it reaches the docker host, and what ``publish`` forwards from there (as
``docker-proxy`` does for a service's ``ports:``), but not the compose network itself, which
Docker does not route from outside (this docker host does not forward at all). ``close()``
removes every namespace, link, forwarder and file it made.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Optional

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from supervise.hosts.network import HostNetwork, HostProcess, Unavailable, ip, subnet_of

__all__ = ["ComposeNetwork", "HostProcess", "Unavailable"]


class _Resolver(BaseResolver):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def resolve(self, request, handler):
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".")
        address = self.names.get(qname)
        if address is None:
            reply.header.rcode = RCODE.NXDOMAIN     # like a compose service that is not running
        elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=5))
        return reply                                 # AAAA of a known name: no answer, no error


class ComposeNetwork(HostNetwork):
    def __init__(self, names: list[str], tag: Optional[str] = None) -> None:
        super().__init__(names, tag)
        self._dns: Optional[DNSServer] = None
        self._lan = subnet_of(self.tag, 232)
        self.outside: dict[str, str] = {}           # host outside the cluster -> its address
        self._proxy: Optional[_Proxy] = None

    def _create(self) -> None:
        super()._create()
        for name in self.addresses:
            self.resolve_with(name, self.gateway)
        quiet = DNSLogger("-request,-reply", prefix=False)          # errors and truncations only
        try:
            self._dns = DNSServer(_Resolver(self.addresses), address=self.gateway, port=53, logger=quiet)
        except OSError as exc:
            raise Unavailable(f"no DNS server on {self.gateway}:53: {exc}") from None
        self._dns.start_thread()

    @property
    def lan_address(self) -> str:
        """The docker host's address on the LAN of the hosts ``add_outside`` makes."""
        return str(self._lan[1])

    def add_outside(self, name: str) -> str:
        """A host on the docker host's LAN, not on the cluster's network; its address."""
        ns, address, uplink = self.namespace(name), str(self._lan[2 + len(self.outside)]), f"rp{self.tag}o{len(self.outside)}"
        ip("netns", "add", ns)
        self._made.append(ns)
        ip("link", "add", uplink, "type", "veth", "peer", "name", "eth0", "netns", ns)
        if not self.outside:
            ip("addr", "add", f"{self.lan_address}/{self._lan.prefixlen}", "dev", uplink)
        ip("link", "set", uplink, "up")
        ip("-n", ns, "addr", "add", f"{address}/{self._lan.prefixlen}", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        # Its way to the compose network is through the docker host, as a LAN machine's would be.
        ip("-n", ns, "route", "add", "default", "via", self.lan_address)
        self.outside[name] = address
        return address

    def publish(self, address: str, port: int, name: str, container_port: int) -> None:
        """Forward connections to ``address:port`` here to ``container_port`` on host ``name``."""
        if self._proxy is None:
            self._proxy = _Proxy()
        self._proxy.forward((address, port), (self.addresses[name], container_port))

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        if self._dns is not None:
            self._dns.stop()
            self._dns = None
        super().close()


class _Proxy:
    """Published ports: each accepted connection is joined to a new one to its target, byte for
    byte both ways (what ``docker-proxy`` does), on an event loop in a thread of its own."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.base_events.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="publish", daemon=True)
        self._thread.start()

    def forward(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        async def joined(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                to_reader, to_writer = await asyncio.open_connection(*target)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, to_writer), pipe(to_reader, writer))

        async def serve() -> asyncio.base_events.Server:
            return await asyncio.start_server(joined, *listen)

        self._servers.append(asyncio.run_coroutine_threadsafe(serve(), self._loop).result(timeout=30))

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
