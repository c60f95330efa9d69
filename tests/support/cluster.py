"""Real role processes for tests: parameter servers, trainers and driver scripts on loopback.

Every process started here is registered with the ``Processes`` owner and stopped in its finaliser,
also when the test fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from services.client import SidecarClient
from supervise.processes import free_port, spawn_role, stop_in_waves
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
# WikiText-2 (a folder of wiki.*.tokens or train/valid/test.txt): tests that read it skip without it.
WIKITEXT = Path(os.environ.get("RPCPS_WIKITEXT") or REPO.parent / "shared" / "datasets" / "wikitext-2")

# A small model so each test step costs milliseconds.
SMALL_MODEL = {"ntoken": 64, "emsize": 16, "nhid": 16, "nlayers": 2, "lr": 0.5}


@dataclass
class Role:
    name: str
    proc: subprocess.Popen
    url: Optional[str]
    log: Path

    def client(self, **kw) -> SidecarClient:
        assert self.url is not None
        return SidecarClient(self.url, **kw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Processes:
    tmp: Path
    master_port: int = field(default_factory=free_port)
    roles: list[Role] = field(default_factory=list)

    def _flags(self, name: str, num_ps: Optional[int], sidecar_port: int, extra: dict) -> list[str]:
        argv = ["--name", name, "--master-port", str(self.master_port),
                "--sidecar-port", str(sidecar_port), "--checkpoint-dir", str(self.tmp / "ckpt")]
        if num_ps is not None:                                # the RL roles have no servers
            argv += ["--num-ps", str(num_ps)]
        for k, v in extra.items():
            if v is True:
                argv.append("--" + k.replace("_", "-"))
            elif v is not None:
                argv += ["--" + k.replace("_", "-"), str(v)]
        return argv

    def start(self, module: str, name: str, num_ps: int, env: Optional[dict] = None, **extra) -> Role:
        port = free_port()
        log = self.tmp / f"{name}-{len(self.roles)}.log"
        proc = spawn_role(module, self._flags(name, num_ps, port, extra), log, env)
        role = Role(name, proc, f"http://127.0.0.1:{port}", log)
        self.roles.append(role)
        return role

    def start_rl(self, role: str, name: str, proc_env: Optional[dict] = None, **extra) -> Role:
        """An RL agent or observer (``rpcps agent|observer``), with its sidecar on a free port;
        ``extra`` are its flags (``env`` among them is the environment to step)."""
        port = free_port()
        log = self.tmp / f"{name}-{len(self.roles)}.log"
        argv = [role, *self._flags(name, None, port, extra)]
        proc = spawn_role("supervise.cli", argv, log, proc_env)
        rl = Role(name, proc, f"http://127.0.0.1:{port}", log)
        self.roles.append(rl)
        return rl

    def start_servers(self, num_ps: int, **model) -> list[Role]:
        servers = [self.start("ps", f"ps{i}", num_ps, **model) for i in range(num_ps)]
        for s in servers:
            self.wait_ready(s)
        return servers

    def wait_ready(self, role: Role, timeout: float = 90.0) -> None:
        def ready() -> bool:
            if role.proc.poll() is not None:
                raise AssertionError(f"{role.name} exited with {role.proc.returncode}:\n{role.log_text()[-3000:]}")
            with role.client(timeout=2.0) as c:
                return c.ready()
        try:
            wait_until(ready, timeout, f"{role.name} ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- {role.name} log ---\n{role.log_text()[-3000:]}") from None

    def spawn_driver(self, mode: str, name: str, num_ps: int, **args) -> subprocess.Popen:
        """Start tests/support/driver.py as a real RPC member (reaped with everything else)."""
        argv = [sys.executable, "-m", "tests.support.driver", mode, "--name", name, "--num-ps", str(num_ps),
                "--master-port", str(self.master_port)]
        for k, v in args.items():
            argv += ["--" + k.replace("_", "-"), str(v)]
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.roles.append(Role(name, proc, None, self.tmp / f"{name}.driver"))
        return proc

    def run_driver(self, mode: str, name: str, num_ps: int, timeout: float = 120.0, **args) -> dict:
        """Run a driver to the end; return the JSON it prints last."""
        proc = self.spawn_driver(mode, name, num_ps, **args)
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"driver {mode} exited {proc.returncode}:\n{err[-4000:]}")
        return json.loads(out.strip().splitlines()[-1])

    @staticmethod
    def finish_drivers(drivers: list[subprocess.Popen], timeout: float = 180.0) -> list[dict]:
        """Drivers spawned together (trainers stepping together), each to its end: the JSON each
        printed last, in their order."""
        results = []
        for proc in drivers:
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise AssertionError(f"driver {' '.join(proc.args[3:5])} exited {proc.returncode}:\n{err[-4000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results

    def stop_all(self) -> None:
        leaders = ("ps0", "agent")
        workers = [(r.name, r.proc) for r in self.roles if not r.name.startswith("ps") and r.name not in leaders]
        servers = [(r.name, r.proc) for r in self.roles if r.name.startswith("ps") and r.name not in leaders]
        leader = [(r.name, r.proc) for r in self.roles if r.name in leaders]
        stop_in_waves([workers, servers, leader], timeout=15.0)
