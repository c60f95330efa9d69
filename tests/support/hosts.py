"""The services of docker-compose.yml running, each on a host of its own (``netns.ComposeNetwork``),
as their containers would: the compose tests' and the link benchmark's."""
from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from supervise.processes import stop_in_waves
from tests.support.deploy import host_process, start_order
from tests.support.netns import ComposeNetwork, HostProcess
from tests.support.wait import wait_until

TOKEN = "netns-test-token"


class Hosts:
    """The running services: one process per host, reaped in compose's stop order."""

    def __init__(self, net: ComposeNetwork, services: dict[str, dict], tmp: Path,
                 environ: dict[str, str] | None = None) -> None:
        """``environ``: what the user's shell or .env sets for compose to interpolate."""
        self.net, self.services, self.tmp = net, services, tmp
        self.environ = {"RPCPS_CONTROL_TOKEN": TOKEN, **(environ or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.order = start_order(services)

    def run_on(self, host: str, key: str, argv: list[str], workdir: Path, env: dict | None = None) -> None:
        """``argv`` as a process on ``host``, known as ``key`` (extras are stopped first by ``down``)."""
        workdir.mkdir(parents=True, exist_ok=True)
        with open(self.tmp / f"{key}.log", "ab") as log:
            self.procs[key] = HostProcess(self.net.exec_argv(host, argv), env=env, cwd=workdir, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def up(self, names: list[str] | None = None, flags: dict[str, list[str]] | None = None) -> None:
        """``flags``: by service, what to add to its command."""
        for name in names or self.order:
            argv, env = host_process(self.services[name], self.tmp / "volumes", self.environ)
            self.run_on(name, name, argv + (flags or {}).get(name, []), self.tmp / "workdir" / name, env)

    def down(self, names: list[str] | None = None) -> dict[str, int]:
        """SIGTERM in reverse start order, each wave waited for (what `docker compose down` does)."""
        extras = [n for n in self.procs if n not in self.order and names is None]
        names = extras + [n for n in reversed(self.order) if n in (names or self.order) and n in self.procs]
        stop_in_waves([[(n, self.procs[n])] for n in names], timeout=60.0)
        return {n: self.procs.pop(n).returncode for n in names}

    def url(self, name: str, path: str) -> str:
        return f"http://{self.net.addresses[name]}:8080{path}"

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")

    def wait_trained(self, trainers: list[str], steps: int) -> None:
        def trained() -> bool:
            self.alive()
            try:
                return all(get_json(self.url(t, "/status")).get("step", 0) >= steps for t in trainers)
            except httpx.HTTPError:
                return False
        wait_until(trained, 180, f"{', '.join(trainers)} past step {steps}")

    def curl(self, on: str, *args: str) -> str:
        """curl run on host ``on`` (so names resolve through the network's DNS)."""
        r = subprocess.run(self.net.exec_argv(on, ["curl", "-sS", "--max-time", "60", *args]),
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, f"curl {args} on {on}: {r.stderr}"
        return r.stdout


def get_json(url: str) -> dict:
    r = httpx.get(url, timeout=5.0)
    r.raise_for_status()
    return r.json()
