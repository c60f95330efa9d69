"""HTTP client of a sidecar, used by the CLI, the launcher and tests."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import httpx


SCALE_WAIT = 900.0      # seconds a change that waits for its servers is followed


class ChangeFailed(RuntimeError):
    """A change of layout that failed, or did not run in time."""


class SidecarError(RuntimeError):
    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status


class SidecarClient:
    def __init__(self, base_url: str, token: Optional[str] = None, timeout: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        # Sidecars speak plain HTTP: loading the CA bundle for a TLS context never used would cost
        # ~90 ms per client, most of what `rpcps status` takes.
        verify = self.base_url.startswith("https:")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SidecarClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                msg = r.json().get("error", r.text)
            except ValueError:
                msg = r.text
            raise SidecarError(self.base_url + path, r.status_code, msg)
        return r.json()

    def ready(self) -> bool:
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def status(self) -> dict:
        return self._json("GET", "/status")

    def start_episode(self, steps: Optional[int] = None, episodes: Optional[int] = None) -> dict:
        body = {k: v for k, v in {"steps": steps, "episodes": episodes}.items() if v is not None}
        return self._json("POST", "/episode/start", json=body)

    def stop_episode(self) -> dict:
        return self._json("POST", "/episode/stop")

    def counts(self) -> dict:
        """A counting server's or trainer's ``GET /counts`` (``--count-updates``)."""
        return self._json("GET", "/counts")

    def checkpoint(self) -> dict:
        return self._json("POST", "/checkpoint")

    def scale(self, servers: int) -> dict:
        return self._json("POST", "/scale", json={"servers": servers}, timeout=900.0)

    def drain(self) -> dict:
        return self._json("POST", "/drain", timeout=900.0)

    def scaled(self, servers: int, timeout: float = SCALE_WAIT,
               waiting: Callable[[dict], None] = lambda asked: None) -> dict:
        """``scale`` once the change ran: one that waits for its new servers to serve (``rpcps up``
        starting them meanwhile; ``waiting`` is told) is followed in the leader's status until it
        is done; a change that failed, or did not run within ``timeout``, raises ``ChangeFailed``."""
        asked = self.scale(servers)
        if asked.get("state") != "waiting":
            return asked
        waiting(asked)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            change = self.status().get("change") or {}
            if change.get("to") == asked["to"] and change.get("epoch", 0) > asked["epoch"] \
                    and change.get("state") in ("done", "failed"):
                if change["state"] == "failed":
                    raise ChangeFailed(f"the change onto {', '.join(asked['to'])} failed, layout {asked['epoch']} "
                                       f"stays in force: {change.get('error')}; ask again once every server serves")
                return change
            time.sleep(0.5)  # noqa: sleep-ok (polling the leader's status, bounded by the deadline)
        raise ChangeFailed(f"the change onto {', '.join(asked['to'])} did not run within {timeout:.0f}s: is "
                           f"{', '.join(asked['awaiting'])} starting? (the leader's /status says what it waits for)")

    def checkpoints(self) -> dict:
        return self._json("GET", "/checkpoints")

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        r.raise_for_status()
        return r.text
