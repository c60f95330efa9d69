"""A stream, as a user runs one: `rpcps up --data DIR --follow` trains on files as they land in DIR
(written aside and renamed into place). A trainer killed while it waits between two files is
replaced and goes on where it was, training nothing again; one killed in the middle of a file,
in the middle of a step or not, is replaced and resumes after its last batch every server
applied, and a server that applied a batch already does not apply it again. At the end each
server has trained each record once: the records it applied, per trainer (its `/status`), add up
to the records written. In sync over CSV, and in async over Parquet."""
import os
import re
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from tests.support.cluster import REPO
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until

EXAMPLES = REPO / "examples"
ROWS, FILES = 400, 4          # records a file, files landed in all
SAMPLES = re.compile(r'^rpcps_trainer_samples_total\{name="(ctr\d)",role="ctr"\} (\S+)$', re.M)


def trained(url):
    """The records this trainer process has trained on (its counter, from 0 when it started)."""
    return sum(float(v) for _, v in SAMPLES.findall(httpx.get(f"{url}/metrics", timeout=5).text))


@pytest.mark.parametrize("consistency,fmt", [("sync", "csv"), ("async", "parquet")])
def test_files_landing_are_trained_once_though_a_trainer_dies_between_two(tmp_path, cleanup, consistency, fmt):
    staging, folder = tmp_path / "staging", tmp_path / "in"
    made = subprocess.run([sys.executable, "-m", "supervise.cli", "data", "ratings", "--rows", str(ROWS * FILES),
                           "--files", str(FILES), "--format", fmt, "--row-group", "100", "--out", str(staging)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    parts = sorted(staging.iterdir())
    folder.mkdir()

    def land(k):
        """File k, renamed into place under a name that sorts in landing order."""
        aside = folder / f".{k:04d}.{fmt}.partial"
        shutil.copy(parts[k], aside)
        os.rename(aside, folder / f"{k:04d}.{fmt}")

    schema = tmp_path / "movies.yaml"
    schema.write_text((EXAMPLES / "movies_deepfm" / "movies.yaml").read_text().replace("format: csv",
                                                                                        f"format: {fmt}"))
    land(0)                  # the vocabularies are counted on what is there at the start
    up = UpProcess(tmp_path, "--workload", "ctr", "--model", "movies_deepfm.model:DeepFM", "--schema", str(schema),
                   "--data", str(folder), "--follow", "--consistency", consistency, "--num-ps", "2",
                   "--num-trainers", "2", "--batch-size", "32", "--eval-samples", "0",
                   # Every step at a twentieth of its speed: a kill lands in the middle of a file.
                   "--jitter", "20", "--jitter-fraction", "1",
                   env={"PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(REPO)])})
    cleanup(up)
    up.wait_event("started", 180)
    urls = up.cluster()["sidecars"]

    def caught_up(newest):
        """Every trainer waits, at the end of file ``newest``."""
        def check():
            for name in ("ctr0", "ctr1"):
                try:
                    status = httpx.get(f"{urls[name]}/status", timeout=5).json()
                except httpx.HTTPError:
                    return False
                position = status.get("data_position") or {}
                if status["reason"] != "waiting for data" or position.get("file") != f"{newest:04d}.{fmt}" or \
                        position.get("record") != ROWS or status.get("behind_records") != 0:
                    return False
            return True
        try:
            wait_until(check, 180, f"both trainers waiting at the end of file {newest}", interval=0.3)
        except AssertionError:
            shown = {n: httpx.get(f"{urls[n]}/status", timeout=5).json() for n in ("ctr0", "ctr1")}
            raise AssertionError({n: {k: v.get(k) for k in ("state", "reason", "data_position", "behind_records",
                                                             "step")} for n, v in shown.items()} | {"logs": up.logs()[-6000:]}) from None

    caught_up(0)
    land(1)
    caught_up(1)
    before_kill = trained(urls["ctr1"])
    assert before_kill > 0
    old_pid = up.cluster()["pids"]["ctr1"]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: up.cluster()["pids"]["ctr1"] != old_pid, 60, "ctr1 restarted")
    caught_up(1)                           # the replacement resumed at the end of file 1, and waits there
    assert trained(urls["ctr1"]) == 0, "the replacement trained nothing again"
    land(2)
    land(3)
    for _ in range(2):              # killed twice in the middle of a file
        def mid_file():
            status = httpx.get(f"{urls['ctr1']}/status", timeout=5).json()
            position = status.get("data_position") or {}
            return status["state"] == "running" and 0 < position.get("record", 0) < ROWS - 64
        wait_until(mid_file, 120, "ctr1 in the middle of a file", interval=0.05)
        old_pid = up.cluster()["pids"]["ctr1"]
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: up.cluster()["pids"]["ctr1"] != old_pid, 60, "ctr1 restarted")
    caught_up(3)

    def applied(ps):
        return httpx.get(f"{urls[ps]}/status", timeout=5).json()["applied"]
    for ps in ("ps0", "ps1"):
        # A server's /status is refreshed each second: wait for it to show the last steps.
        def records(ps=ps):
            return {t: a["records"] for t, a in applied(ps)["trainers"].items()}
        try:
            wait_until(lambda: sum(records().values()) == ROWS * FILES, 15, f"{ps}'s records to add up")
        except AssertionError:
            print(up.logs())        # the assertion's own message is cut short
            raise AssertionError((ps, applied(ps))) from None
        # A replacement resumes after its last batch every server applied: at most the one batch
        # a kill left applied on one server only is repeated there, per kill.
        assert applied(ps)["repeated"] <= 2, applied(ps)
    print("repeated batches not applied again:", {ps: applied(ps)["repeated"] for ps in ("ps0", "ps1")})
    metrics = httpx.get(f"{urls['ctr0']}/metrics", timeout=5).text
    assert 'rpcps_trainer_behind_records{name="ctr0",role="ctr"} 0.0' in metrics
    assert up.terminate(timeout=60) == 0, up.logs()
    done = up.wait_event("done", 5)
    assert done["restarts"] >= 1, done


def test_bench_stream_measures_event_to_prediction():
    # The benchmark as a user runs it, briefly: each landed file is served, and the figure is the
    # time to both every trainer past it and an answer that changed.
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "bench", "stream", "--files", "2", "--rows", "512",
                           "--batch-size", "256"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert [f["file"] for f in out["files"]] == ["0000.tsv", "0001.tsv"], out
    for f in out["files"]:
        assert 0 < f["answer_changed_s"] <= f["served_s"] and f["trainers_past_s"] <= f["served_s"], f
    assert set(out["met"]) == {"median_within_5s"}, out


def test_a_source_of_your_own_trains_and_resumes_from_its_own_position(tmp_path):
    # `--source module:Class`: the tests' stand-in for a message queue, one class against
    # rpcps.data.Source. Its position (a queue offset) is in the checkpoint, and a second run goes
    # on from it.
    schema = tmp_path / "ratings.yaml"
    schema.write_text((REPO / "tests/support/ratings_schema.yaml").read_text().replace(
        "{column: age, standardize: true}", "{column: age, standardize: true, mean: 38, std: 12}"))
    flags = ["--workload", "ctr", "--model", "tests.support.ratings_model:RatingsModel", "--schema", str(schema),
             "--source", "tests.support.queue_source:RatingsQueue", "--num-ps", "1", "--num-trainers", "2",
             "--batch-size", "32", "--eval-samples", "200", "--json", "--state-dir", str(tmp_path / "state"),
             "--checkpoint-dir", str(tmp_path / "ck")]

    def up(steps):
        done = subprocess.run([sys.executable, "-m", "supervise.cli", "up", *flags, "--steps", str(steps)],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        return [__import__("json").loads(line) for line in done.stdout.splitlines() if '"done"' in line][-1]
    first = up(4)
    assert first["steps"] == 4 and 0 < first["auc"] < 1 and first["eval_samples"] == 200, first
    second = up(6)
    assert second["total_steps"] >= 6, second
    log = (tmp_path / "state" / "logs" / "ctr0.log").read_text()
    assert "data: the tests' ratings queue" in log
    # 4 steps of 32 records each, every other offset: ctr0's next is 256.
    assert re.search(r"resumed position from step-\d+ \(same trainers, same data\): offset 256, step 4", log), \
        log[-3000:]
    flags[flags.index("--source") + 1] = "tests.support.queue_source:Nothing"
    wrong = subprocess.run([sys.executable, "-m", "supervise.cli", "up", *flags, "--steps", "1", "--no-resume"],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert wrong.returncode != 0
    assert "--source tests.support.queue_source:Nothing: tests.support.queue_source has no Nothing" in wrong.stderr
    # A source that fails at every start: the run ends with its error, never a restart loop.
    flags[flags.index("--source") + 1] = "tests.support.queue_source:Dropping"
    looped = subprocess.run([sys.executable, "-m", "supervise.cli", "up", *flags, "--steps", "50", "--no-resume",
                             "--restart-backoff", "0.2"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert looped.returncode == 1, looped.stderr[-3000:]
    events = [__import__("json").loads(line) for line in looped.stdout.splitlines() if line.startswith("{")]
    said = "ConnectionError: the ratings queue at 127.0.0.1:9 reset the connection"
    restarts = [e for e in events if e["event"] == "restart"]
    assert restarts and all(said in e["reason"] for e in restarts), restarts
    errors = [e["message"] for e in events if e["event"] == "error"]
    assert any(re.match(rf"ctr\d failed the same way at each of its last 3 starts: .*{said}", m) for m in errors), errors
