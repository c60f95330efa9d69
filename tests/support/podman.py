"""A real container engine on this machine: Debian's podman (with podman-compose from PyPI) on an
emulated host of its own (``supervise/hosts/``), as a Docker host on a LAN. Its containers, their
bridge, DNS and firewall rules live inside that host; its images, containers and volumes in a
storage folder of its own, so nothing of a machine's own podman is touched. The host's address is
where compose publishes ports (``RPCPS_PUBLISH_ADDR``), which this machine reaches over the
hosts' bridge.

What podman needs on a machine like this one (cgroup v1 controllers beside a v2 mount holding
none; limits that cannot be raised): the engine's mount namespace without the v2 mount, container
cgroups off, ``nofile``/``nproc`` ulimits it may set, and output read through a pipe. No image
registry is reachable, so base images are made from Debian's archive with ``mmdebstrap``.
``close()`` removes every container, volume, network and image it made, and the host."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

from supervise.hosts.emulated import EmulatedHosts
from supervise.hosts.network import HostProcess
from tests.support.wait import wait_until

ENGINE = "engine"
PROGRAMS = ("podman", "mmdebstrap", "iptables", "dnsmasq")
DNSNAME = Path("/usr/lib/cni/dnsname")

# PID 1 of the engine's host: reaps what podman leaves to it (conmon forks away from podman).
_REAPER = textwrap.dedent("""
    import os, time
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)  # noqa: sleep-ok (a reaper idling, not a test waiting)
""")


def missing() -> Optional[str]:
    """Why a container engine cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "podman on an emulated host needs root"
    absent = [p for p in PROGRAMS if shutil.which(p) is None] + ([] if DNSNAME.exists() else ["dnsname"])
    if absent:
        return ("podman and its networking are not installed (apt-get install podman mmdebstrap iptables "
                f"golang-github-containernetworking-plugin-dnsname): {absent}")
    if shutil.which("podman-compose", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}") is None:
        return "podman-compose is not installed (pip install podman-compose==1.6.0)"
    return None


class Engine:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.hosts = EmulatedHosts([ENGINE])
        self._init: Optional[HostProcess] = None
        self._pid = 0

    @property
    def address(self) -> str:
        return self.hosts.address(ENGINE)

    def start(self) -> "Engine":
        try:
            self.hosts.create()
            # The engine's host has no route out, so no resolver it could ask answers: its own
            # address refuses at once, so names not on a compose network fail fast, as on a LAN
            # whose resolver does not know them (containers and dnsname's dnsmasq ask upstream).
            self.hosts.net.resolve_with(ENGINE, self.address)
            self._write_conf()
            umount = "umount /sys/fs/cgroup/unified 2>/dev/null; exec \"$0\" -c \"$1\""
            self._init = self.hosts.spawn(ENGINE, ["sh", "-c", umount, sys.executable, _REAPER],
                                          self.folder / "engine.log")
            self._pid = wait_until(self._namespace_init, 30, "the engine host's first process")
        except BaseException:
            self.close()
            raise
        return self

    def _namespace_init(self) -> int:
        children = Path(f"/proc/{self._init.pid}/task/{self._init.pid}/children").read_text().split()
        if self._init.poll() is not None:
            raise AssertionError(f"the engine host ended: {(self.folder / 'engine.log').read_text()}")
        return int(children[0]) if children and _is_reaper(int(children[0])) else 0

    def _write_conf(self) -> None:
        storage, run, cni = self.folder / "storage", self.folder / "run", self.folder / "cni"
        for d in (storage, run, cni):
            d.mkdir(parents=True, exist_ok=True)
        (self.folder / "containers.conf").write_text(textwrap.dedent(f"""\
            [containers]
            cgroups = "disabled"
            default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
            [engine]
            cgroup_manager = "cgroupfs"
            events_logger = "file"
            tmp_dir = "{run / 'libpod'}"
            [network]
            network_backend = "cni"
            network_config_dir = "{cni}"
            """))
        (self.folder / "storage.conf").write_text(textwrap.dedent(f"""\
            [storage]
            driver = "overlay"
            graphroot = "{storage}"
            runroot = "{run / 'storage'}"
            """))

    def environ(self) -> dict[str, str]:
        return {"CONTAINERS_CONF": str(self.folder / "containers.conf"),
                "CONTAINERS_STORAGE_CONF": str(self.folder / "storage.conf"),
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def run(self, argv: list[str], cwd: Optional[Path] = None, env: Optional[dict] = None, timeout: float = 600,
            check: bool = True) -> subprocess.CompletedProcess:
        """``argv`` on the engine's host, inside its namespaces; output read through pipes."""
        r = subprocess.run(["nsenter", f"--target={self._pid}", "--net", "--mount", "--pid", "--uts", *argv],
                           capture_output=True, text=True, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL,
                           env={**os.environ, **self.environ(), **(env or {})})
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited with {r.returncode}:\n"
                                 f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def podman(self, *argv: str, **kw) -> subprocess.CompletedProcess:
        return self.run(["podman", *argv], **kw)

    def import_base(self, name: str, include: list[str]) -> None:
        """A Debian bookworm image with ``include``'s packages, from Debian's archive as this
        machine's apt reaches it (the engine's host has no route out)."""
        tar = self.folder / f"{name.replace('/', '_').replace(':', '_')}.tar"
        r = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(include)}",
                            "--mode=root", "--format=tar", "bookworm", str(tar)],
                           capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"mmdebstrap failed:\n{r.stderr[-3000:]}"
        self.podman("import", str(tar), name)
        tar.unlink()

    def close(self) -> None:
        """Every container, pod, volume, network and image gone, then the host and the storage."""
        try:
            if self._pid:
                self.podman("rm", "--all", "--force", "--time", "0", check=False, timeout=120)
                self.podman("system", "reset", "--force", check=False, timeout=300)
        finally:
            self._pid = 0
            if self._init is not None:
                self._init.kill()
                self._init.wait(30)
                self._init = None
            self.hosts.close()      # ends whatever is left in the host, removes its namespace
            shutil.rmtree(self.folder / "storage", ignore_errors=True)
            shutil.rmtree(self.folder / "run", ignore_errors=True)


def _is_reaper(pid: int) -> bool:
    try:
        return "os.wait()" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
