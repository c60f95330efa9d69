"""Separate hosts on one machine, shaped like a compose network (for tests; needs root).

Each host is a network namespace with its own ``eth0`` and address on a shared bridge (the bridge
lives in a namespace of its own), and each process on it a PID namespace of its own: containers
do not see each other's processes, so TensorPipe cannot move tensors by cross-memory attach
between them and every byte crosses the network, as in compose. Names resolve as compose's embedded DNS resolves them: a DNS
server (dnslib, in this process) answers each host's name with its address, and every namespace's
``/etc/resolv.conf`` points at it (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/*`` over
``/etc``). The test's own namespace is on the bridge too, as the docker host is, so it reaches the
hosts directly. ``close()`` removes every namespace, link and file it made.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

ETC_NETNS = Path("/etc/netns")


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
