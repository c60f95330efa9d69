"""The README's commands as a user runs them: `rpcps up`, `rpcps status`, `rpcps episode`."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.support.cluster import WIKITEXT
from tests.support.sockets import is_loopback, listening
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until

FAST = ["--emsize", "32", "--nhid", "32", "--batch-size", "10", "--bptt", "20", "--progress-interval", "1"]


def cli(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "supervise.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**os.environ, **(env or {})})


@pytest.mark.skipif(not WIKITEXT.is_dir(), reason="shared WikiText-2 not present")
def test_up_steps_on_wikitext2_loss_falls_and_reports_perplexity(tmp_path, cleanup):
    # Its 40 steps take about two seconds: report often enough to see training midway.
    up = UpProcess(tmp_path, "--steps", "40", "--data", str(WIKITEXT), "--eval-tokens", "4000", *FAST,
                   "--progress-interval", "0.2")
    cleanup(up)
    started = up.wait_event("started", 120)
    assert set(started["sidecars"]) == {"ps0", "ps1", "trainer0", "trainer1"}

    status = cli(tmp_path, "status", "--state-dir", str(up.state_dir))
    assert status.returncode == 0, status.stderr
    lines = status.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("ps0") and "trainer1" in status.stdout, status.stdout

    done = up.wait_event("done", 300)
    assert up.proc.wait(15) == 0, up.logs()
    progress = [e for e in up.events if e["event"] == "progress"]
    assert progress and all({"step", "loss", "tokens_per_s", "percent", "eta_s", "elapsed_s"} <= set(e)
                            for e in progress), progress
    # Training's share done grows with its steps, and an ETA follows from the recent rate once
    # every trainer has one: a trainer still starting (no step yet) leaves the ETA unknown.
    training = [e for e in progress if e["phase"] == "train" and e["percent"] is not None and 0 < e["percent"] < 100]
    rated = [e for e in training if all(step > 0 for step in e["trainers"].values())]
    assert rated and all(e["eta_s"] is not None and e["eta_s"] >= 0 for e in rated), training
    assert [e["percent"] for e in training] == sorted(e["percent"] for e in training), training
    waiting = [e for e in up.events if e["event"] == "waiting"]
    assert waiting and waiting[0]["members"] == 4 and waiting[0]["ready"] < 4, waiting
    assert done["steps"] == 40 and done["tokens_per_s"] > 0, done
    # Starts untrained (uniform over ~18k words is 9.8; the second trainer's first step may already
    # see one update of the first's), and falls by more than a nat in 40 steps.
    assert done["loss_first"] > math.log(18000) - 1.5, done
    assert done["loss_last"] < done["loss_first"] - 1.0, done
    assert done["val_tokens"] >= 3000 and 1 < done["val_ppl"] < math.exp(done["loss_first"]), done


def test_episode_stop_and_start_from_the_cli(tmp_path, cleanup):
    up = UpProcess(tmp_path, *FAST, "--synthetic-tokens", "20000")
    cleanup(up)
    up.wait_event("started", 120)
    state = ["--state-dir", str(up.state_dir)]

    def trainers():
        r = cli(tmp_path, "status", "--json", *state)
        rows = json.loads(r.stdout)
        return [rows["trainer0"], rows["trainer1"]]

    wait_until(lambda: all(t.get("step", 0) >= 2 for t in trainers()), 60, "training")
    # Nothing of a local cluster listens beyond loopback: store, RPC and sidecars alike.
    pids = set(json.loads((up.state_dir / "cluster.json").read_text())["pids"].values())
    sockets = listening(pids)
    assert len({pid for pid, _ in sockets}) == 4, sockets
    assert all(is_loopback(address) for _, address in sockets), [s for s in sockets if not is_loopback(s[1])]
    r = cli(tmp_path, "episode", "stop", *state)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: all(t["state"] == "idle" for t in trainers()), 60, "trainers idle")
    r = cli(tmp_path, "episode", "start", "--steps", "3", *state)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: all((t.get("episode") or {}).get("id") == 2 and t["episode"]["done"] for t in trainers()),
               60, "second episode of 3 steps done")
    assert all(t["episode"]["step"] == 3 for t in trainers())
    # /status's progress: the second episode's 3 steps done (or its evaluation, after them).
    assert all(t["progress"]["phase"] == "evaluate" or (t["progress"]["done"], t["progress"]["total"]) == (3, 3)
               for t in trainers()), trainers()
    assert up.terminate() == 0
    assert up.wait_event("done", 5)["steps"] == 3


def test_human_progress_output(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supervise.cli", "up", "--steps", "3", "--ps", "1", "--trainers", "1",
                        "--state-dir", str(tmp_path / "s"), *FAST, "--synthetic-tokens", "5000"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()
    started = next(i for i, line in enumerate(out) if line.startswith("started ps0 http://"))
    assert started > 0 and all(re.fullmatch(r"waiting for [a-z0-9, ]+ \(\d/2 ready\)", line) for line in out[:started]), out
    assert out[-1].startswith("done: 3 steps | loss "), out
