"""A serving member started by `rpcps up --serve 1`, reading the live servers through its cache: a
prediction follows training within the staleness bound; killed, it is started again and training
never stops; once training stops, it answers exactly as the export of that moment's checkpoint (a
delta on an earlier one); with a server gone it refuses (503 naming it) or answers with that same
model, never another; with a server frozen it answers 503 naming it within the request's deadline."""
import csv
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from services.checkpoint.store import CheckpointStore
from tests.support.cluster import REPO
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until
from trainer.ctr.serving.sources import Snapshot

STALENESS = 0.5
SUPPORT = REPO / "tests" / "support"


def cli(cwd, *args):
    return subprocess.run([sys.executable, "-m", "supervise.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def rows_of(data, count):
    with (data / "part_0.csv").open(newline="") as f:
        lines = [r for _, r in zip(range(count), csv.DictReader(f))]
    # The schema keeps 2 genres a row (a file's longer list is cut; a request's would be refused).
    return [{**{k: (float(v) if v else None) if k in ("age", "year") else v for k, v in r.items()},
             "genres": r["genres"].split("|")[:2]} for r in lines]


def predict(url, rows):
    answer = httpx.post(f"{url}/predict", json={"rows": rows}, timeout=30)
    return answer.status_code, answer.json()


def steps(url):
    return httpx.get(f"{url}/status", timeout=5).json().get("step", 0)


@pytest.mark.timeout(300)
def test_online_serving_follows_training_and_never_serves_another_model(tmp_path, cleanup):
    made = cli(tmp_path, "data", "ratings", "--rows", "3000", "--out", str(tmp_path / "data"))
    assert made.returncode == 0, made.stderr
    data = tmp_path / "data"
    up = UpProcess(tmp_path / "run", "--workload", "ctr", "--model", "tests.support.ratings_model:RatingsModel",
                   "--schema", str(SUPPORT / "ratings_schema.yaml"), "--data", str(data), "--batch-size", "64",
                   "--eval-samples", "200", "--num-ps", "2", "--num-trainers", "1", "--serve", "1",
                   "--serve-staleness", str(STALENESS), "--progress-interval", "1", "--full-checkpoint-every", "2",
                   env={"PYTHONPATH": str(REPO)})
    cleanup(up)
    up.wait_event("started", 180)
    sidecars = up.cluster()["sidecars"]
    serve, trainer, ps0 = sidecars["serve0"], sidecars["ctr0"], sidecars["ps0"]
    rows = rows_of(data, 16)

    # Training moves the served model within the bound.
    code, first = predict(serve, rows)
    assert code == 200 and first["served"]["source"] == "online", first
    at = steps(trainer)
    wait_until(lambda: steps(trainer) >= at + 20, 60, "20 more training steps")
    moved = time.monotonic()
    later = wait_until(lambda: (a := predict(serve, rows)[1])["predictions"] != first["predictions"] and a,
                       STALENESS + 5, "a prediction that reflects the new steps")
    assert later["served"]["step"] > first["served"]["step"] and time.monotonic() - moved < STALENESS + 5
    assert later["served"]["age_s"] <= STALENESS + 1, later
    assert httpx.post(f"{ps0}/checkpoint", timeout=60).status_code == 200     # full: the next one is a delta

    # A serving member killed: started again; training does not wait for it.
    pid = up.cluster()["pids"]["serve0"]
    os.kill(pid, signal.SIGKILL)
    at = steps(trainer)
    wait_until(lambda: steps(trainer) >= at + 20, 60, "training going on while serve0 is down")
    wait_until(lambda: up.cluster()["pids"]["serve0"] != pid and predict(serve := up.cluster()["sidecars"]["serve0"],
                                                                          rows)[0] == 200,
               90, "serve0 started again and answering")
    serve = up.cluster()["sidecars"]["serve0"]

    # Training stopped and checkpointed (a delta on the one before): online answers as its export.
    assert httpx.post(f"{trainer}/episode/stop", timeout=10).status_code == 200
    wait_until(lambda: httpx.get(f"{trainer}/status", timeout=5).json()["state"] == "idle", 60, "ctr0 idle")
    taken = httpx.post(f"{ps0}/checkpoint", timeout=60).json()
    assert CheckpointStore(tmp_path / "run" / "ckpt").resolve(taken["id"], verify=False).kind == "delta", taken
    exported = cli(tmp_path, "export", "--checkpoint", str(tmp_path / "run" / "ckpt" / taken["id"]), "--out",
                   str(tmp_path / "model"), "--data", str(data))
    assert exported.returncode == 0, exported.stderr
    snapshot = Snapshot(tmp_path / "model", 100)
    expected, _ = snapshot.answer(snapshot.rows.rows({"rows": rows}))
    same = lambda answer: max(abs(a - b) for a, b in zip(answer["predictions"], expected)) < 1e-6  # noqa: E731
    wait_until(lambda: same(predict(serve, rows)[1]), STALENESS + 3, "online answering as the exported checkpoint")

    # A server gone: a refusal naming it, or the same model (restored from that checkpoint), never another.
    pid = up.cluster()["pids"]["ps1"]
    os.kill(pid, signal.SIGKILL)
    codes = []

    def back() -> bool:
        code, answer = predict(serve, rows)
        assert (code == 503 and "ps1" in answer["error"]) or (code == 200 and same(answer)), (code, answer)
        codes.append(code)
        return code == 200 and up.cluster()["pids"]["ps1"] != pid

    wait_until(back, 90, "ps1 started again and serve0 answering")

    # A server frozen (for less than --member-timeout): a request whose rows must be read again
    # answers 503 naming it within the request's deadline (the read's, 5 s), and none waits past it.
    wait_until(lambda: "ps1" in up.cluster()["answering"], 30, "rpcps up to hear the restarted ps1")
    frozen = up.cluster()["pids"]["ps1"]
    os.kill(frozen, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_until(lambda: time.monotonic() - stopped > STALENESS, 2, "the cache's bound to pass")
        answered = predict(serve, rows)
        waited = time.monotonic() - stopped - STALENESS
    finally:
        os.kill(frozen, signal.SIGCONT)
    print(f"ps1 frozen: /predict answered {answered[0]} after {waited:.1f}s")
    assert answered[0] == 503 and "ps1" in answered[1]["error"] and waited < 10, (answered, waited)
    assert up.terminate(60) == 0, up.logs()
