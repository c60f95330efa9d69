"""Separate hosts on one machine, shaped like a compose network (for tests; needs root).

Each host is a network namespace with its own ``eth0`` and address on a shared bridge (the bridge
lives in a namespace of its own), and each process on it a PID namespace of its own: containers
do not see each other's processes, so TensorPipe cannot move tensors by cross-memory attach
between them and every byte crosses the network, as in compose. Names resolve as compose's embedded DNS resolves them: a DNS
server (dnslib, in this process) answers each host's name with its address, and every namespace's
``/etc/resolv.conf`` points at it (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/*`` over
``/etc``). The test's own namespace is on the bridge too, as the docker host is, so it reaches the
hosts directly. A host *outside* the cluster (``add_outside``) is a machine on the docker host's
LAN: it reaches the docker host, and what ``publish`` forwards from there (as ``docker-proxy``
does for a service's ``ports:``), but not the compose network itself, which Docker does not route
from outside (this docker host does not forward at all). ``close()`` removes every namespace, link,
forwarder and file it made.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import threading
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

ETC_NETNS = Path("/etc/netns")


# Run on a host by ``HostNetwork.reachable``: connects to every (address, port) read from stdin at
# once, and prints those that accepted.
_PROBE = textwrap.dedent("""
    import json, socket, sys
    from concurrent.futures import ThreadPoolExecutor

    def accepts(target):
        try:
            socket.create_connection(tuple(target), timeout=float(sys.argv[1])).close()
            return True
        except OSError:
            return False

    targets = json.load(sys.stdin)
    with ThreadPoolExecutor(max(len(targets), 1)) as pool:
        print(json.dumps([t for t, ok in zip(targets, pool.map(accepts, targets)) if ok]))
""")


class HostProcess(subprocess.Popen):
    """A process started through ``HostNetwork.exec_argv``: ``unshare`` waits for it and exits
    with its code, but ignores signals, so they go to the process itself (PID 1 of its namespace)."""

    def send_signal(self, sig: int) -> None:
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            os.kill(int(children[0]), sig)
        else:
            super().send_signal(sig)


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, or the kernel refuses)."""


def _ip(*argv: str) -> None:
    r = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise Unavailable(f"ip {' '.join(argv)}: {r.stderr.strip()}")


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


class HostNetwork:
    def __init__(self, names: list[str], tag: Optional[str] = None) -> None:
        self.tag = tag or str(os.getpid() % 100000)
        third = os.getpid() % 200 + 20
        self.subnet = ipaddress.ip_network(f"10.231.{third}.0/24")
        self.gateway = str(self.subnet[1])          # this namespace's address: the "docker host"
        self.addresses = {n: str(self.subnet[10 + i]) for i, n in enumerate(names)}
        self._switch = f"rpcps{self.tag}net"
        self._uplink = f"rp{self.tag}h"
        self._made: list[str] = []
        self._dns: Optional[DNSServer] = None
        self._lan = ipaddress.ip_network(f"10.232.{third}.0/24")
        self.outside: dict[str, str] = {}           # host outside the cluster -> its address
        self._proxy: Optional[_Proxy] = None

    def namespace(self, name: str) -> str:
        return f"rpcps{self.tag}-{name}"

    def exec_argv(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run on host ``name``, in a PID namespace of its own (start it with
        ``HostProcess``, which signals the process itself: ``unshare`` does not forward signals)."""
        return ["ip", "netns", "exec", self.namespace(name),
                "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *argv]

    def counters(self, name: str) -> int:
        """Bytes host ``name``'s ``eth0`` has sent and received."""
        ns = self.namespace(name)
        out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/eth0/statistics/rx_bytes",
                              "/sys/class/net/eth0/statistics/tx_bytes"], capture_output=True, text=True, timeout=30)
        return sum(int(v) for v in out.stdout.split())

    def limit(self, name: str, rate: Optional[str]) -> None:
        """Host ``name`` sends at most ``rate`` (tc's units: ``1gbit``, ``100mbit``; None: as fast as
        the veth pair goes), as a link of that speed out of it would: a token bucket on its ``eth0``
        (``tc qdisc ... tbf``), queueing up to 200 ms of traffic."""
        ns = self.namespace(name)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True,
                       timeout=30)
        if rate is not None:
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                                rate, "burst", "256kb", "latency", "200ms"], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise Unavailable(f"tc cannot limit {name}'s link to {rate}: {r.stderr.strip()}")

    def listening(self, name: str) -> set[tuple[str, int]]:
        """The TCP (address, port) pairs something on host ``name`` listens on; a wildcard address
        is given as the host's own."""
        out = subprocess.run(["ip", "netns", "exec", self.namespace(name), "ss", "-Htln"],
                             capture_output=True, text=True, timeout=30, check=True)
        found = set()
        for line in out.stdout.splitlines():
            address, _, port = line.split()[3].rpartition(":")
            address = address.strip("[]")
            found.add((self.addresses[name] if address in ("*", "0.0.0.0", "::") else address, int(port)))
        return found

    @property
    def lan_address(self) -> str:
        """The docker host's address on the LAN of the hosts ``add_outside`` makes."""
        return str(self._lan[1])

    def add_outside(self, name: str) -> str:
        """A host on the docker host's LAN, not on the cluster's network; its address."""
        ns, address, uplink = self.namespace(name), str(self._lan[2 + len(self.outside)]), f"rp{self.tag}o{len(self.outside)}"
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "add", uplink, "type", "veth", "peer", "name", "eth0", "netns", ns)
        if not self.outside:
            _ip("addr", "add", f"{self.lan_address}/{self._lan.prefixlen}", "dev", uplink)
        _ip("link", "set", uplink, "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self._lan.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        # Its way to the compose network is through the docker host, as a LAN machine's would be.
        _ip("-n", ns, "route", "add", "default", "via", self.lan_address)
        self.outside[name] = address
        return address

    def publish(self, address: str, port: int, name: str, container_port: int) -> None:
        """Forward connections to ``address:port`` here to ``container_port`` on host ``name``."""
        if self._proxy is None:
            self._proxy = _Proxy()
        self._proxy.forward((address, port), (self.addresses[name], container_port))

    def reachable(self, name: str, targets: list[tuple[str, int]], timeout: float = 2.0) -> set[tuple[str, int]]:
        """Which of ``targets`` a TCP connection from host ``name`` reaches (all tried at once)."""
        out = subprocess.run(["ip", "netns", "exec", self.namespace(name), sys.executable, "-c", _PROBE, str(timeout)],
                             input=json.dumps([list(t) for t in targets]), capture_output=True, text=True,
                             timeout=timeout * 4 + 30, check=True)
        return {(a, int(p)) for a, p in json.loads(out.stdout)}

    def create(self) -> "HostNetwork":
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise Unavailable("creating network namespaces needs root and iproute2's `ip`")
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        prefix = self.subnet.prefixlen
        _ip("netns", "add", self._switch)
        self._made.append(self._switch)
        _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._switch, "link", "set", "br0", "up")
        _ip("link", "add", self._uplink, "type", "veth", "peer", "name", "up0", "netns", self._switch)
        _ip("-n", self._switch, "link", "set", "up0", "master", "br0", "up")
        _ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self._uplink)
        _ip("link", "set", self._uplink, "up")
        for i, (name, address) in enumerate(self.addresses.items()):
            ns = self.namespace(name)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", self._switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self._switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            # A container's /etc/hosts names only itself; every other name goes to the DNS server.
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{address} {name}\n")
            (etc / "resolv.conf").write_text(f"nameserver {self.gateway}\noptions timeout:1 attempts:2\n")
        quiet = DNSLogger("-request,-reply", prefix=False)          # errors and truncations only
        try:
            self._dns = DNSServer(_Resolver(self.addresses), address=self.gateway, port=53, logger=quiet)
        except OSError as exc:
            raise Unavailable(f"no DNS server on {self.gateway}:53: {exc}") from None
        self._dns.start_thread()

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        if self._dns is not None:
            self._dns.stop()
            self._dns = None
        subprocess.run(["ip", "link", "del", self._uplink], capture_output=True, timeout=30)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        self._made.clear()
        try:
            ETC_NETNS.rmdir()                        # only if nothing else uses it
        except OSError:
            pass


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
