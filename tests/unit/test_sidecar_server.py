"""The sidecar's HTTP server on loopback (no cluster): whatever fails answers in the documented JSON
shape, and a client that sends part of a request and waits is cut off after the read timeout while
the others are answered."""
import socket
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.http_server import SidecarServer
from services.sidecar import create_app
from tests.support.fakes import FakeControl

HTTP_READ_TIMEOUT = 1.0


class Failing(FakeControl):
    def status(self):
        raise RuntimeError("a bug nobody foresaw")

    def list_checkpoints(self):
        return [{"id": "step-1", "loss": float("nan"), "seen": [float("inf"), 2.5]}]


@pytest.fixture
def server():
    with SidecarServer(create_app(Failing(), CollectorRegistry()), "127.0.0.1", 0, HTTP_READ_TIMEOUT) as s:
        yield s


def test_an_unforeseen_failure_is_a_json_500_and_a_value_json_cannot_hold_is_null(server):
    r = httpx.get(server.url + "/status")
    assert r.status_code == 500
    assert r.json() == {"error": "internal error: RuntimeError: a bug nobody foresaw", "type": "InternalError"}
    r = httpx.get(server.url + "/checkpoints")
    assert r.status_code == 200 and r.json() == {"checkpoints": [{"id": "step-1", "loss": None, "seen": [None, 2.5]}]}
    r = httpx.get(server.url + "/nowhere")
    assert r.status_code == 404 and r.json()["error"] == "Not Found"


def _closed(sock: socket.socket, deadline: float) -> bytes:
    """What the server sent before it closed the connection (fails past ``deadline``)."""
    got = b""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    while chunk := sock.recv(4096):
        got += chunk
    return got


def test_clients_that_send_part_of_a_request_are_cut_off_and_the_others_answered(server):
    host, port = "127.0.0.1", server.port
    partial = [b"", b"GET /status HTTP/1.1\r\nHost: x\r\n",                          # nothing, half the headers
               b"POST /episode/start HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
               b"content-length: 100\r\n\r\n{\"steps\":"]                                # half the body
    slow = []
    began = time.monotonic()
    try:
        for k in range(128):
            sock = socket.create_connection((host, port))
            slow.append(sock)
            sock.sendall(partial[k % 3])
        # Meanwhile whole requests are answered at once, and one sent in pieces within the timeout too.
        with httpx.Client(base_url=server.url) as client:
            assert client.get("/healthz").status_code == 200
        piecewise = socket.create_connection((host, port))
        for piece in (b"GET /healthz HTT", b"P/1.1\r\nHost: x\r\n", b"Connection: close\r\n\r\n"):
            piecewise.sendall(piece)
        assert _closed(piecewise, time.monotonic() + 5).startswith(b"HTTP/1.1 200")
        deadline = began + HTTP_READ_TIMEOUT + 10
        answers = [_closed(sock, deadline) for sock in slow]
        waited = time.monotonic() - began
    finally:
        for sock in slow:
            sock.close()
    assert waited >= HTTP_READ_TIMEOUT * 0.9
    for k, answer in enumerate(answers):
        if k % 3 == 2:      # a request under way: nobody to answer, the connection is closed
            assert answer == b"", answer
        else:
            assert answer.startswith(b"HTTP/1.1 408") and b'"type":"RequestTimeout"' in answer, answer
