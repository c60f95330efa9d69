"""The serving member without a cluster: a request's rows checked against the schema and read as
a training file's lines are; concurrent requests batched; its route over HTTP (an ASGI transport),
answering from an exported folder written here."""
import asyncio
import csv
import threading

import httpx
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import rpcps
from services.errors import InvalidInput, NotReady, Overloaded, PeerUnavailable
from services.lifecycle import StatusBoard
from services.role import RoleContext
from services.sidecar import create_app
from tests.support.exported import KNOWN_USERS, write_builtin, write_exported
from trainer.ctr.serving.batcher import MicroBatcher
from trainer.ctr.serving.config import ServeSettings
from trainer.ctr.serving.role import ServeRole
from trainer.ctr.serving.routes import SERVED_HEADER, add_routes
from trainer.ctr.serving.rows import SchemaRows
from trainer.ctr.serving.sources import Snapshot
from trainer.ctr.serving.status import ServeMetrics, ServeStatus

ROW = {"user_id": "7", "movie_id": 31, "genres": ["Drama", "Comedy"], "occupation": "4", "age": 25, "year": 1994.0}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return write_exported(tmp_path_factory.mktemp("serving") / "model")


@pytest.fixture(scope="module")
def snapshot(exported):
    return Snapshot(exported, 10)


def test_rows_answer_as_the_same_lines_of_a_training_file(snapshot, tmp_path):
    rows = [ROW, dict(ROW, user_id=str(KNOWN_USERS + 3), genres="Action", age=None, year=2050),
            dict(ROW, genres=[], occupation=None, movie_id="", user_id=12)]
    scores, served = snapshot.answer(snapshot.rows.rows({"rows": rows, "ignored": 1}))
    # The same rows as a CSV file, read as a trainer reads it.
    path = tmp_path / "rows.csv"
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["label", *ROW])
        for r in rows:
            out.writerow([0] + ["|".join(map(str, v)) if isinstance(v, list) else ("" if v is None else v)
                                for v in r.values()])
    batch = next(rpcps.batches(snapshot.model.schema, path, 10))
    with torch.no_grad():
        expected = torch.sigmoid(snapshot.model(batch)).tolist()
    assert scores == expected and len(set(scores)) == 3
    assert served.source == "snapshot" and served.checkpoint == "step-7" and 4 < served.age() < 60


def test_the_builtin_dlrm_reads_a_row_as_its_trainers_read_a_criteo_line(tmp_path):
    from rpcps.data.criteo import write
    from rpcps.data.builders import CriteoFeatures
    from rpcps.data.generated import SyntheticCtr
    snapshot = Snapshot(write_builtin(tmp_path / "model"), 100)
    path = tmp_path / "day_0.tsv"
    with path.open("w") as f:
        write(SyntheticCtr.fitting(snapshot.model.exported["criteo"]["cardinalities"]), np.arange(64), f)
    rows = []
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        rows.append({**{f"I{j}": int(v) if v else None for j, v in enumerate(fields[1:14], 1)},
                     **{f"C{t}": v or None for t, v in enumerate(fields[14:], 1)}})
    rows[1]["C5"] = rows[2]["I4"] = None                 # empty fields, as a line may have them
    path.write_text("\n".join(["\t".join(["0", *("" if v is None else str(v) for v in r.values())]) for r in rows]))
    scores, _ = snapshot.answer(snapshot.rows.rows({"rows": rows}))
    batch = next(CriteoFeatures([path], snapshot.rows.cardinalities).batches(64))
    with torch.no_grad():
        assert scores == torch.sigmoid(snapshot.model(batch)).tolist()
    assert snapshot.rows.cardinalities[2] == snapshot.rows.cardinalities[11] == 0      # C3, C12: raw ids
    for row, said in [(dict(rows[0], C5="xyz"), "rows[0]: categorical C5 is not 1 to 8 hexadecimal digits: 'xyz'"),
                      (dict(rows[0], I2=1.5), "rows[0].I2: expected an integer or null, got a number 1.5"),
                      (dict(rows[0], C1=7), "rows[0].C1: expected 1 to 8 hexadecimal digits as a string or null"),
                      (dict(rows[0], C1="\ud800"), "rows[0].C1: expected 1 to 8 hexadecimal digits as a string")]:
        with pytest.raises(InvalidInput) as refused:
            snapshot.rows.rows({"rows": [row]})
        assert str(refused.value).startswith(said), str(refused.value)


@pytest.mark.parametrize("row,said", [
    ({k: v for k, v in ROW.items() if k != "age"}, "rows[0]: missing column age"),
    (dict(ROW, age="25"), 'rows[0].age: expected a number or null, got a string "25"'),
    (dict(ROW, age=True), "rows[0].age: expected a number or null, got a boolean"),
    (dict(ROW, age=float("nan")), "rows[0].age: expected a number within float32's range"),
    (dict(ROW, age=1e308), "rows[0].age: expected a number within float32's range (±3.403e+38), the model's, got 1e+308"),
    (dict(ROW, age=-1.7e308), "rows[0].age: expected a number within float32's range"),
    (dict(ROW, age=7.26e92), "rows[0].age: expected a number within float32's range"),
    (dict(ROW, age=10 ** 400), "rows[0].age: expected a number within float32's range"),
    (dict(ROW, user_id="\ud800"), 'rows[0].user_id: not text (it holds a lone UTF-16 surrogate): "\\ud800"'),
    (dict(ROW, genres=["Drama", "x\udfff"]), "rows[0].genres[1]: not text"),
    (dict(ROW, movie_id=3.5), "rows[0].movie_id: expected a string or an integer, got a number 3.5"),
    (dict(ROW, movie_id=["1"]), "rows[0].movie_id: one value (the column is not a list)"),
    (dict(ROW, genres=["a", "b", "c"]), "rows[0].genres: 3 values, at most 2"),
    (dict(ROW, genres="a|b|c"), "rows[0].genres: 3 values, at most 2"),
    (dict(ROW, genres=["a|b"]), "rows[0].genres[0]: holds the separator '|'"),
    (dict(ROW, genres=[{"x": 1}]), "rows[0].genres[0]: expected a string or an integer, got an object"),
    ("not a row", "rows[0]: expected an object of columns, got a string"),
])
def test_a_row_that_does_not_fit_is_refused_naming_it(snapshot, row, said):
    with pytest.raises(InvalidInput) as refused:
        snapshot.rows.rows({"rows": [row]})
    assert str(refused.value).startswith(said), str(refused.value)


@pytest.mark.parametrize("body,said", [([ROW], "the body is a JSON object"), ({"rows": []}, "rows: empty"),
                                       ({"row": [ROW]}, "the body is a JSON object"),
                                       ({"rows": [ROW] * 11}, "rows: 11 rows, at most 10")])
def test_a_body_that_is_not_rows_is_refused(snapshot, body, said):
    with pytest.raises(InvalidInput, match=said):
        SchemaRows(snapshot.model.schema, 10).rows(body)


def test_requests_that_arrive_during_a_pass_share_the_next_one():
    started, release, passes = threading.Event(), threading.Event(), []

    def answer(rows):
        passes.append(len(rows))
        started.set()
        release.wait(10)
        return [float(r) for r in rows], "said"

    batcher = MicroBatcher(answer, batch_rows=8, wait=0.0, queue_rows=100)
    try:
        first = batcher.submit([0])
        assert started.wait(10)
        waiting = [batcher.submit([k, k]) for k in range(1, 6)]        # 10 rows: 8 in the next pass, then 2
        release.set()
        assert first.result(10) == ([0.0], "said")
        assert [w.result(10)[0] for w in waiting] == [[float(k)] * 2 for k in range(1, 6)]
        assert passes == [1, 8, 2]
    finally:
        release.set()
        batcher.close()


def test_a_full_queue_refuses_at_once_and_a_failed_pass_fails_only_its_requests():
    gate, calls = threading.Event(), []

    def answer(rows):
        calls.append(rows)
        gate.wait(10)
        if rows == ["bad"]:
            raise ValueError("broken pass")
        return [1.0] * len(rows), None

    batcher = MicroBatcher(answer, batch_rows=4, wait=0.0, queue_rows=4)
    try:
        busy = batcher.submit(["a"])
        while not calls:
            threading.Event().wait(0.01)
        batcher.submit(["b"] * 4)
        with pytest.raises(Overloaded, match="4 rows are waiting"):
            batcher.submit(["c"])
        gate.set()
        assert busy.result(10)[0] == [1.0]
        with pytest.raises(ValueError, match="broken pass"):
            batcher.submit(["bad"]).result(10)
        assert batcher.submit(["d"]).result(10)[0] == [1.0]
    finally:
        gate.set()
        batcher.close()
    with pytest.raises(NotReady):
        batcher.submit(["e"])


def test_a_bad_request_fails_alone_in_a_shared_pass_and_a_lost_server_fails_the_pass():
    gate, calls = threading.Event(), []

    def answer(rows):
        calls.append(list(rows))
        gate.wait(10)
        if "bad" in rows:
            raise ValueError("broken pass")
        if "server lost" in rows:
            raise PeerUnavailable("ps1 is gone")
        return [float("nan") if r == "nan" else 1.0 for r in rows], None

    batcher = MicroBatcher(answer, batch_rows=8, wait=0.0, queue_rows=100)
    try:
        # Requests that share a pass with a bad one: the pass runs again request by request.
        busy = batcher.submit(["e"])
        while not calls:
            threading.Event().wait(0.01)
        good, bad, nan = batcher.submit(["f"]), batcher.submit(["g", "bad"]), batcher.submit(["h", "nan"])
        gate.set()
        assert busy.result(10)[0] == good.result(10)[0] == [1.0]
        with pytest.raises(ValueError, match="broken pass"):
            bad.result(10)
        with pytest.raises(InvalidInput, match=r"rows\[1\]: the model's answer is nan, not a number"):
            nan.result(10)
        assert calls == [["e"], ["f", "g", "bad", "h", "nan"], ["f"], ["g", "bad"], ["h", "nan"]]
        # A domain error (a server lost) is the whole pass's: it is not run again row by row.
        gate.clear()
        calls.clear()
        busy = batcher.submit(["i"])
        while not calls:
            threading.Event().wait(0.01)
        lost = [batcher.submit(["j"]), batcher.submit(["server lost"])]
        gate.set()
        for future in lost:
            with pytest.raises(PeerUnavailable):
                future.result(10)
        assert calls == [["i"], ["j", "server lost"]]
    finally:
        gate.set()
        batcher.close()


def test_a_request_whose_caller_gave_up_is_dropped_and_the_batcher_goes_on():
    gate, calls = threading.Event(), []

    def answer(rows):
        calls.append(list(rows))
        gate.wait(10)
        return [1.0] * len(rows), None

    batcher = MicroBatcher(answer, batch_rows=8, wait=0.0, queue_rows=100)
    try:
        busy = batcher.submit(["a"])
        while not calls:
            threading.Event().wait(0.01)
        gone, kept = batcher.submit(["b"]), batcher.submit(["c"])
        assert gone.cancel()                    # what a request's timeout does to the future it awaits
        gate.set()
        assert busy.result(10)[0] == [1.0] and kept.result(10)[0] == [1.0]
        assert calls == [["a"], ["c"]]
    finally:
        gate.set()
        batcher.close()


def _role(exported, **settings):
    cfg = ServeSettings(snapshot=exported, **settings)
    metrics = ServeMetrics(CollectorRegistry(), "serve", cfg.name)
    ctx = RoleContext(metrics=metrics, board=StatusBoard("serve", cfg.name, ServeStatus), endpoint=None,
                      membership=None, store=None, checkpoints=None)
    return ServeRole(cfg, ctx)


def request(app, method, path, **kw):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def test_predict_over_http_answers_refuses_and_counts(exported):
    role = _role(exported, body_bytes=2048, request_rows=4)
    app = create_app(role, role.metrics.registry, token="secret", routes=add_routes)
    assert request(app, "POST", "/predict", json={"rows": [ROW]}).status_code == 503    # not loaded yet
    runner = threading.Thread(target=role.run, daemon=True)
    runner.start()
    try:
        deadline = threading.Event()
        while not role.ready()[0]:
            assert runner.is_alive() and not deadline.wait(0.05)
        ok = request(app, "POST", "/predict", json={"rows": [ROW, dict(ROW, user_id="8")]})
        assert ok.status_code == 200, ok.text
        body = ok.json()
        assert len(body["predictions"]) == 2 and all(0 < p < 1 for p in body["predictions"])
        assert body["served"]["checkpoint"] == "step-7" and ok.headers[SERVED_HEADER] == "snapshot step-7"
        bad = request(app, "POST", "/predict", json={"rows": [dict(ROW, year="x")]})
        assert bad.status_code == 422 and "rows[0].year" in bad.json()["error"]
        assert request(app, "POST", "/predict", content=b"{nope").status_code == 422
        huge = request(app, "POST", "/predict", json={"rows": [ROW] * 40})
        assert huge.status_code == 413 and "at most 2048" in huge.json()["error"], huge.text
        assert request(app, "POST", "/predict", json={"rows": [ROW] * 5}).status_code == 422
        # Reading needs no token; what changes state does, and a serving member has none of it.
        assert request(app, "POST", "/checkpoint").status_code == 401
        said = request(app, "POST", "/checkpoint", headers={"authorization": "Bearer secret"})
        assert said.status_code == 501 and "holds nothing a checkpoint keeps" in said.json()["error"]
        status = request(app, "GET", "/status").json()
        counted = ("requests_answered", "requests_refused", "rows_answered", "source")
        assert [status[k] for k in counted] == [1, 4, 2, "snapshot"], status
        metrics = request(app, "GET", "/metrics").text
        assert 'rpcps_serve_requests_total{name="serve0",outcome="invalid",role="serve"} 3.0' in metrics
        assert 'rpcps_serve_requests_total{name="serve0",outcome="too_large",role="serve"} 1.0' in metrics
        assert "rpcps_serve_pass_rows_count" in metrics and "rpcps_serve_age_seconds" in metrics
    finally:
        role.request_stop()
        runner.join(10)
        role.close()


def test_a_snapshot_that_needs_measured_statistics_says_to_export_with_data(tmp_path, exported):
    import json
    import shutil
    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    schema = json.loads((copy / "schema.json").read_text())
    for n in schema["numeric"]:
        n["mean"] = n["std"] = None
    (copy / "schema.json").write_text(json.dumps(schema))
    with pytest.raises(Exception, match="export again with --data"):
        Snapshot(copy, 10)


def test_the_row_cache_serves_rows_within_the_bound_and_keeps_to_its_capacity():
    from trainer.ctr.serving.sources import RowCache
    cache = RowCache(capacity=3)
    cache.put("t", torch.tensor([1, 2]), torch.ones(2, 4), at=100.0)
    cache.put("u", torch.tensor([7]), torch.full((1, 4), 7.0), at=101.0)
    found, missing = cache.split("t", torch.tensor([1, 2, 3]), since=99.0)
    assert sorted(found) == [1, 2] and missing.tolist() == [3]
    found, missing = cache.split("t", torch.tensor([1, 2]), since=100.5)        # read before the bound: again
    assert not found and missing.tolist() == [1, 2]
    assert (cache.hits, cache.misses) == (2, 3)
    cache.put("t", torch.tensor([3]), torch.zeros(1, 4), at=102.0)              # a fourth row: the oldest goes
    assert cache.size == 3
    found, missing = cache.split("t", torch.tensor([1, 2, 3]), since=0.0)
    assert sorted(found) == [2, 3] and missing.tolist() == [1]
    assert cache.split("u", torch.tensor([7]), since=0.0)[0][7][1].tolist() == [7.0] * 4
