"""Hosts on one machine: each a network namespace with its own ``eth0`` and address on a shared
bridge (the bridge in a namespace of its own), and each process started on one in PID, UTS and
mount namespaces of its own. The PID namespace is what makes them hosts rather than processes:
between processes of one PID namespace TensorPipe moves tensors by cross-memory attach, so
nothing would cross the "network". The namespace that makes them is on the bridge too (at the
``gateway`` address), as a docker host or a login node is, so it reaches every host directly;
nothing routes out of the bridge. ``close()`` removes every namespace and link it made.

Processes enter a host with ``nsenter --net``, not ``ip netns exec``: the latter remounts
``/sys``, which Slurm's daemons and podman's runtime refuse. Files in ``/etc/netns/<namespace>/``
(a ``resolv.conf``, say) are bind-mounted over ``/etc`` as ``ip netns exec`` would.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

ETC_NETNS = Path("/etc/netns")

# TCP on every host: a segment lost while a link is down is sent again after a back-off that
# doubles up to 120 s, so a cut of 8 s stalled its connections 5 s past the link's return. Capped
# at 3 s (Linux 6.15 and later), a connection goes on within about a second of it. The cap also
# shortens the time TCP gives up on a connection after (modelled on tcp_retries2's retries): 255
# retries keep that near 750 s, past the longest --member-timeout (600 s), as the default does.
TCP_SETTINGS = {"net/ipv4/tcp_rto_max_ms": "3000", "net/ipv4/tcp_retries2": "255"}

# Run in a host's own mount and UTS namespaces before its command: its /etc files and its name.
_ENTER = ('for f in "$1"/*; do [ -f "$f" ] && mount --bind "$f" "/etc/${f##*/}"; done; '
          'hostname "$2"; shift 2; exec "$@"')

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


class Unavailable(RuntimeError):
    """Hosts cannot be emulated here (not root, no ``ip``, or the kernel refuses)."""


class HostProcess(subprocess.Popen):
    """A process started through ``HostNetwork.exec_argv``: ``unshare`` waits for it and exits
    with its code, but ignores signals, so they go to the process itself (PID 1 of its namespace).
    Killing ``unshare`` kills it too (``--kill-child``)."""

    def send_signal(self, sig: int) -> None:
        member = host_child(self.pid)
        if member is not None:
            os.kill(member, sig)
        else:
            super().send_signal(sig)


def host_child(pid: int) -> Optional[int]:
    """The process ``unshare`` (``pid``) runs on a host: its one child, PID 1 of the host's PID
    namespace; None before it starts or once it has ended."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def ip(*argv: str) -> None:
    r = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise Unavailable(f"ip {' '.join(argv)}: {r.stderr.strip()}")


def link_counters(namespace: str) -> dict[str, int]:
    """Bytes the ``eth0`` of network namespace ``namespace`` has received and sent."""
    out = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True,
                         timeout=30, check=True)
    stats = json.loads(out.stdout)[0]["stats64"]
    return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}


def subnet_of(tag: str, second: int) -> ipaddress.IPv4Network:
    """A /24 of 10.``second``.x.0 that differs between the networks of concurrent runs."""
    return ipaddress.ip_network(f"10.{second}.{int(tag) % 200 + 20}.0/24")


class HostNetwork:
    def __init__(self, names: list[str], tag: Optional[str] = None) -> None:
        self.tag = tag or str(os.getpid() % 100000)
        self.subnet = subnet_of(self.tag, 231)
        self.gateway = str(self.subnet[1])          # the namespace that made the hosts
        # Each host's number (its address and its bridge port), never given to another: a host
        # removed while the others run leaves a gap.
        self._number = {n: i for i, n in enumerate(names)}
        self.addresses = {n: str(self.subnet[10 + i]) for n, i in self._number.items()}
        self.switch = f"rpcps{self.tag}net"          # the bridge's namespace
        self.uplink = f"rp{self.tag}h"              # this namespace's link to the bridge
        self._made: list[str] = []

    def namespace(self, name: str) -> str:
        return f"rpcps{self.tag}-{name}"

    def enter_argv(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` in host ``name``'s network namespace, sharing everything else with the caller
        (a tool that inspects the host: ``ss``, ``tc``, a probe)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace(name)}", *argv]

    def exec_argv(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run on host ``name`` as its own machine would run it: its network, a PID
        namespace of its own (start it with ``HostProcess``, which signals the process itself),
        its hostname, and its ``/etc/netns`` files over ``/etc``."""
        return self.enter_argv(name, ["unshare", "--pid", "--uts", "--fork", "--kill-child", "--mount-proc",
                                      "sh", "-c", _ENTER, "rpcps-host", str(ETC_NETNS / self.namespace(name)), name,
                                      *argv])

    def counters(self, name: str) -> dict[str, int]:
        """Bytes host ``name``'s ``eth0`` has received and sent: ``{"rx": …, "tx": …}``."""
        return link_counters(self.namespace(name))

    def limit(self, name: str, rate: Optional[str]) -> None:
        """Host ``name`` sends at most ``rate`` (tc's units: ``1gbit``, ``100mbit``; None: as fast as
        the veth pair goes), as a link of that speed out of it would: a token bucket on its ``eth0``
        (``tc qdisc ... tbf``), queueing up to 200 ms of traffic. Its burst is above the MTU
        (smaller, every packet would be dropped)."""
        ns = self.namespace(name)
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"], capture_output=True, timeout=30)
        if rate is not None:
            r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                                "burst", "256kb", "latency", "200ms"], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise Unavailable(f"tc cannot limit {name}'s link to {rate}: {r.stderr.strip()}")

    def listening(self, name: str) -> set[tuple[str, int]]:
        """The TCP (address, port) pairs something on host ``name`` listens on; a wildcard address
        is given as the host's own."""
        out = subprocess.run(self.enter_argv(name, ["ss", "-Htln"]), capture_output=True, text=True, timeout=30,
                             check=True)
        found = set()
        for line in out.stdout.splitlines():
            address, _, port = line.split()[3].rpartition(":")
            address = address.strip("[]")
            found.add((self.addresses[name] if address in ("*", "0.0.0.0", "::") else address, int(port)))
        return found

    def reachable(self, name: str, targets: list[tuple[str, int]], timeout: float = 2.0) -> set[tuple[str, int]]:
        """Which of ``targets`` a TCP connection from host ``name`` reaches (all tried at once)."""
        out = subprocess.run(self.enter_argv(name, [sys.executable, "-c", _PROBE, str(timeout)]),
                             input=json.dumps([list(t) for t in targets]), capture_output=True, text=True,
                             timeout=timeout * 4 + 30, check=True)
        return {(a, int(p)) for a, p in json.loads(out.stdout)}

    def create(self) -> "HostNetwork":
        missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
        if os.geteuid() != 0 or missing:
            raise Unavailable("emulated hosts need root and iproute2's `ip` and `tc` and util-linux's `nsenter` "
                              f"and `unshare`{f' (missing: {missing})' if missing else ' (not root)'}")
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        prefix = self.subnet.prefixlen
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        ip("link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", self.switch)
        ip("-n", self.switch, "link", "set", "up0", "master", "br0", "up")
        ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.uplink)
        ip("link", "set", self.uplink, "up")
        for name in self.addresses:
            self._host(name)

    def add(self, name: str) -> str:
        """One more host on the bridge, while the others run (a fenced member's replacement goes
        to a fresh one: its old host may be cut off); its address."""
        if name in self.addresses:
            raise ValueError(f"host {name} exists already")
        number = max(self._number.values(), default=-1) + 1
        if 10 + number >= self.subnet.num_addresses - 1:
            raise Unavailable(f"no address is left for host {name} in {self.subnet}")
        self._number[name], self.addresses[name] = number, str(self.subnet[10 + number])
        self._host(name)
        return self.addresses[name]

    def remove_host(self, name: str) -> None:
        """Host ``name``'s namespace (its link to the bridge goes with it) and ``/etc/netns`` files
        removed; its processes must have ended."""
        ns = self.namespace(name)
        remove([ns], None)
        self._made.remove(ns)
        del self.addresses[name]

    def _host(self, name: str) -> None:
        i, address, prefix = self._number[name], self.addresses[name], self.subnet.prefixlen
        ns = self.namespace(name)
        ip("netns", "add", ns)
        self._made.append(ns)
        ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        _tcp_settings(ns)
        etc = ETC_NETNS / ns
        etc.mkdir(parents=True, exist_ok=True)
        # A host knows its own name; others it resolves through the resolv.conf a caller writes.
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{address} {name}\n")

    def connect(self, name: str, up: bool) -> None:
        """Host ``name``'s link up or down: down, it is cut off as a host whose network failed is,
        its processes running on (a partition); up, it is back."""
        ip("-n", self.namespace(name), "link", "set", "eth0", "up" if up else "down")

    def resolve_with(self, name: str, server: str) -> None:
        """Host ``name`` asks ``server`` for names (its ``/etc/resolv.conf``), giving up within 2 s."""
        (ETC_NETNS / self.namespace(name) / "resolv.conf").write_text(
            f"nameserver {server}\noptions timeout:1 attempts:2\n")

    def name_each_other(self) -> None:
        """Every host resolves every other's name, as a cluster's shared ``/etc/hosts`` (or its DNS)
        lets nodes do; by default a host knows only its own."""
        known = "".join(f"{address} {name}\n" for name, address in self.addresses.items())
        for name in self.addresses:
            (ETC_NETNS / self.namespace(name) / "hosts").write_text(f"127.0.0.1 localhost\n{known}")

    def close(self) -> None:
        remove(self._made, self.uplink)
        self._made.clear()


def _tcp_settings(namespace: str) -> None:
    """``TCP_SETTINGS`` in ``namespace`` (its own /proc/sys/net); those this kernel lacks left out
    (no cap on the back-off before Linux 6.15)."""
    script = "; ".join(f'[ -e /proc/sys/{key} ] && echo {value} > /proc/sys/{key}'
                       for key, value in TCP_SETTINGS.items()) + "; true"
    subprocess.run(["nsenter", f"--net=/run/netns/{namespace}", "sh", "-c", script], check=True,
                   capture_output=True, timeout=30)


def remove(namespaces: list[str], uplink: Optional[str]) -> None:
    """Namespaces and their ``/etc/netns`` files removed, newest first, and the uplink to their
    bridge (None: it stays)."""
    if uplink is not None:
        subprocess.run(["ip", "link", "del", uplink], capture_output=True, timeout=30)
    for ns in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    try:
        ETC_NETNS.rmdir()                        # only if nothing else uses it
    except OSError:
        pass
