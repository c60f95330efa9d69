"""Runs the sidecar's uvicorn server in a daemon thread.

uvicorn installs no signal handlers off the main thread, so the role's own SIGTERM handling stays in
charge; stopping is ``should_exit`` plus a join.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class SidecarServer:
    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        # Bind the socket ourselves so port 0 resolves to a real port we can report. Named TCP, so
        # asyncio turns Nagle's algorithm off on each connection (it checks the protocol number):
        # with it on, a response written as headers then body waits out the client's delayed ACK,
        # 40 ms a request on a kept-alive connection.
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                   socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="sidecar", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "SidecarServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"sidecar failed to start on {self.host}:{self.port}")
            time.sleep(0.01)
        log.info("sidecar listening on %s", self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "SidecarServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
