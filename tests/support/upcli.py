"""``rpcps up`` as a user runs it: a real subprocess whose JSON lines the test reads as they come."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.support.wait import wait_until


class UpProcess:
    def __init__(self, tmp: Path, *args: str, env: dict | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.state_dir = tmp / "state"
        argv = [sys.executable, "-m", "supervise.cli", "up", "--json", "--state-dir", str(self.state_dir),
                "--checkpoint-dir", str(tmp / "ckpt"), *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, cwd=tmp, env={**os.environ, **(env or {})})
        self.events: list[dict] = []
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def drain(self) -> list[dict]:
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return self.events
            try:
                self.events.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"rpcps up --json printed a non-JSON line: {line!r}") from None

    def wait_event(self, kind: str, timeout: float, **match) -> dict:
        def find():
            if self.proc.poll() is not None:
                self.drain()
            for e in self.drain():
                if e.get("event") == kind and all(e.get(k) == v for k, v in match.items()):
                    return e
            if self.proc.poll() is not None:
                raise AssertionError(f"no {kind} event: {self.explain()}")
            return None
        return wait_until(find, timeout, f"a {kind} event from rpcps up", interval=0.2)

    def explain(self) -> str:
        """What a failing test shows of the run: how it ended if it did, its last events, its stderr."""
        ended = "runs" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return f"rpcps up {ended}; events {self.drain()[-10:]}; stderr {''.join(self._stderr)[-3000:]}"

    def cluster(self) -> dict:
        return json.loads((self.state_dir / "cluster.json").read_text())

    def full_logs(self) -> str:
        return "\n".join(f.read_text(errors="replace") for f in sorted((self.state_dir / "logs").glob("*.log")))

    def logs(self) -> str:
        out = []
        for f in sorted((self.state_dir / "logs").glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2500:]}")
        return "\n".join(out)

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """Last resort in finalisers: the launcher and every role it recorded."""
        pids = []
        try:
            pids = list(self.cluster()["pids"].values())
        except Exception:
            pass
        for pid in [self.proc.pid, *pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)


def run_to_done(tmp: Path, *args: str, timeout: float = 180, env: dict | None = None) -> tuple[UpProcess, dict]:
    """One ``rpcps up --json`` to its end: its process (events, logs) and its ``done`` event."""
    up = UpProcess(tmp, *args, env=env)
    try:
        done = up.wait_event("done", timeout)
        assert up.proc.wait(15) == 0, up.logs()
        return up, done
    finally:
        up.kill()
