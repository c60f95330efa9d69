"""Runs the sidecar's uvicorn server in a daemon thread.

uvicorn installs no signal handlers off the main thread, so the role's own SIGTERM handling stays in
charge; stopping is ``should_exit`` plus a join.

uvicorn times out nothing but an idle kept-alive connection, and any byte cancels that: a client
that sends part of a request and waits holds its connection for ever. ``http_read_timeout`` bounds how
long a client may take to send a whole request, headers and body.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Optional

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def _deadline_protocol(http_read_timeout: float) -> type[H11Protocol]:
    class ReadDeadline(H11Protocol):
        """A request must arrive whole within ``http_read_timeout`` seconds of the connection's opening,
        or of the answer before it: else 408 (while no request has begun) and the connection closes."""

        _deadline: Optional[asyncio.TimerHandle] = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(http_read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()          # the request is in whole: the answer may take its time

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:
                body = json.dumps({"error": f"no whole request within {http_read_timeout:g}s (--http-read-timeout)",
                                   "type": "RequestTimeout"}, separators=(",", ":")).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return ReadDeadline


class SidecarServer:
    def __init__(self, app: FastAPI, host: str, port: int, http_read_timeout: float = 10.0) -> None:
        # Bind the socket ourselves so port 0 resolves to a real port we can report. Named TCP, so
        # asyncio turns Nagle's algorithm off on each connection (it checks the protocol number):
        # with it on, a response written as headers then body waits out the client's delayed ACK,
        # 40 ms a request on a kept-alive connection.
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                   socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                http=_deadline_protocol(http_read_timeout))
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
