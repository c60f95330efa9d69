"""`rpcps serve` over real HTTP, sent what a careless or hostile client sends: every case seen to
fail a member before, a bad row beside good ones sharing its passes, bodies made at random from a
seed, and clients that send part of a request and wait. No input gets a 5xx or a body that is not
the documented JSON, no prediction sent is not a probability, and no request fails another."""
import json
import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.cluster import REPO, Processes
from tests.support.exported import write_exported

ROW = {"user_id": "7", "movie_id": 31, "genres": ["Drama", "Comedy"], "occupation": "4", "age": 25, "year": 1994.0}
READ_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    owner = Processes(tmp)
    try:
        role = owner.start_rl("serve", "serve0", {**os.environ, "PYTHONPATH": str(REPO)},
                              snapshot=write_exported(tmp / "model"), batch_wait_ms=5, body_bytes=4 << 20,
                              http_read_timeout=READ_TIMEOUT)
        owner.wait_ready(role)
        yield role.url
    finally:
        owner.stop_all()


def row_with(**values) -> bytes:
    """A one-row body, the values written as JSON text as given (escapes and all)."""
    fields = {k: json.dumps(v) for k, v in ROW.items()}
    fields.update(values)
    return ('{"rows": [{' + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}]}").encode()


def answered(response: httpx.Response) -> dict:
    """The body, checked to be what the docs promise for its status."""
    assert response.status_code < 500, (response.status_code, response.text[:300])
    body = response.json()
    if response.status_code == 200:
        assert all(0.0 <= p <= 1.0 for p in body["predictions"]), body
    else:
        assert set(body) == {"error", "type"} and body["error"], body
    return body


CASES = [
    (row_with(user_id='"\\ud800"'), 422, "rows[0].user_id: not text"),
    (row_with(genres='["Drama", "\\udfff"]'), 422, "rows[0].genres[1]: not text"),
    (row_with(age="1e308"), 422, "rows[0].age: expected a number within float32's range"),
    (row_with(year="-1.7e308"), 422, "rows[0].year: expected a number within float32's range"),
    (row_with(age="7.26e92"), 422, "rows[0].age: expected a number within float32's range"),
    (row_with(age="1" * 400), 422, "rows[0].age: expected a number within float32's range"),
    (b"[" * 200_000, 422, "the body nests lists or objects deeper"),
    (row_with(genres="[" * 100_000 + "]" * 100_000), 422, "the body nests lists or objects deeper"),
    (b'{"rows": [{"user_id": "7"', 422, "the body is not JSON"),
    (b"\xff\xfe{}", 422, "the body is not JSON"),
    (b" " * (5 << 20), 413, "at most 4194304 (--body-bytes)"),
]


@pytest.mark.parametrize("body,status,said", CASES, ids=[f"case{k}" for k in range(len(CASES))])
def test_each_case_seen_is_refused_naming_it(serve, body, status, said):
    r = httpx.post(serve + "/predict", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status and said in answered(r)["error"], r.text[:300]


def test_a_bad_row_sent_beside_good_ones_fails_only_its_own_request(serve):
    bad = [row_with(user_id='"\\ud800"'), row_with(genres='["\\udfff"]'), row_with(age="1e308")]
    bodies = [(True, json.dumps({"rows": [dict(ROW, user_id=str(k))]}).encode()) for k in range(75)]
    for k, body in enumerate(bad * 5):
        bodies.insert(k * 5, (False, body))
    with httpx.Client(base_url=serve, timeout=30) as client, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda b: client.post("/predict", content=b[1]), bodies))
    good = [a for (ok, _), a in zip(bodies, answers) if ok]
    assert [a.status_code for a in good] == [200] * 75, [a.text for a in good if a.status_code != 200][:3]
    assert all(a.status_code == 422 for (ok, _), a in zip(bodies, answers) if not ok)
    for a in answers:
        answered(a)


def _value(rng: random.Random, depth: int = 0):
    """Any JSON value, leaning to the kinds that broke members: odd text, extreme numbers, nesting."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2 ** 63, -(2 ** 64), 10 ** rng.randrange(1, 500), rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e-320, 3.4e38, 3.5e38, -1e300, 1e308, rng.uniform(-1e6, 1e6),
                           float(f"1e{rng.randrange(-400, 400)}")])
    if kind in (4, 5):
        alphabet = "ab|,\t\n\"\\ \x00é漢\U0001f600\ud800\udfff"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
    if kind in (6, 7):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(list(ROW) + ["x"]): _value(rng, depth + 1) for _ in range(rng.randrange(0, 3))}


def _body(rng: random.Random) -> bytes:
    shape = rng.randrange(10)
    if shape == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if shape == 1:
        return json.dumps(_value(rng)).encode()
    rows = []
    for _ in range(rng.randrange(1, 4)):
        row = dict(ROW)
        for column in rng.sample(list(ROW), rng.randrange(1, 3)):
            if rng.random() < 0.1:
                del row[column]
            else:
                row[column] = _value(rng)
        rows.append(row)
    return json.dumps({"rows": rows}).encode()        # json.dumps writes a lone surrogate as its escape


def test_bodies_made_at_random_never_get_a_5xx_nor_a_value_that_is_not_a_probability(serve):
    rng = random.Random(43)
    bodies = [_body(rng) for _ in range(400)]
    with httpx.Client(base_url=serve, timeout=30) as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: client.post("/predict", content=b), bodies))
    statuses = [a.status_code for a in answers]
    for a in answers:
        answered(a)
    # The generator reaches both sides: some bodies are served, most are refused.
    assert statuses.count(200) >= 10 and statuses.count(422) >= 200, sorted(set(statuses))
    assert httpx.post(serve + "/predict", json={"rows": [ROW]}).status_code == 200


def test_clients_that_send_part_of_a_request_are_cut_off_while_others_are_answered(serve):
    host, port = httpx.URL(serve).host, httpx.URL(serve).port
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n"
    slow = []
    began = time.monotonic()
    try:
        for k in range(128):
            sock = socket.create_connection((host, port))
            sock.sendall(head if k % 2 else head + b'\r\n{"rows": [')
            slow.append(sock)
        assert httpx.post(serve + "/predict", json={"rows": [ROW]}, timeout=10).status_code == 200
        for sock in slow:
            sock.settimeout(max(0.01, began + READ_TIMEOUT + 20 - time.monotonic()))
            while sock.recv(4096):          # until the member closes it (a timeout here fails the test)
                pass
        waited = time.monotonic() - began
    finally:
        for sock in slow:
            sock.close()
    assert READ_TIMEOUT * 0.9 <= waited
    assert httpx.get(serve + "/status").json()["state"] == "running"
