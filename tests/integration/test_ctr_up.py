"""The CTR workload as a user runs it: `rpcps data ctr` writes Criteo files, `rpcps up --workload
ctr --data` trains on them (a malformed line skipped and counted, a malformed file refused at the
start), reports held-out AUC and logloss in its done event, status and metrics, and a restart on
another server count resumes from its checkpoint, resharded (its trainers having read batches
ahead: the checkpoint resumes before them); a server killed twice costs the
trainers a step each time, not their processes; members killed at random, the leader among them,
come back and training goes on (with hashed tables)."""
import json
import math
import os
import re
import subprocess
import sys

import torch

from rpcps.data.generated import SyntheticCtr
from services.client import SidecarClient
from tests.support.serverloss import lose_server
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until

SMALL = ["--workload", "ctr", "--scale", "0.001", "--dim", "8", "--bottom", "32", "--top", "32", "--batch-size", "256",
         "--eval-samples", "1000", "--progress-interval", "1"]
# Every table keyed by raw ids within 300 rows (over the servers), ids admitted when seen twice.
HASHED = ["--tables", "hashed", "--table-capacity", "300", "--admit-after", "2", "--evict-after-steps", "4"]


def cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "supervise.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(os.environ))


def test_ctr_on_criteo_files_trains_reports_quality_and_resumes_resharded(tmp_path, cleanup):
    data = tmp_path / "data"
    made = cli(tmp_path, "data", "ctr", "--rows", "6000", "--files", "2", "--scale", "0.001", "--out", str(data))
    assert made.returncode == 0, made.stderr
    assert [f["lines"] for f in json.loads(made.stdout)["files"]] == [3000, 3000]
    with open(data / "day_0.tsv", "a") as f:      # read in training (the first 1000 lines are held out)
        f.write("1\t2\tthree\n")

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "day_0.tsv").write_text("1\t" + "\t".join(["x"] * 39) + "\n")
    refused = cli(tmp_path, "up", *SMALL, "--data", str(bad), "--steps", "2")
    assert refused.returncode == 2 and "day_0.tsv:1: count I1 (field 2) is not an integer: 'x'" in refused.stderr, \
        refused.stderr

    up = UpProcess(tmp_path / "first", *SMALL, "--data", str(data), "--steps", "8", "--num-ps", "2", "--prefetch", "2")
    cleanup(up)
    up.wait_event("started", 120)
    done = up.wait_event("done", 300)
    assert up.proc.wait(30) == 0, up.logs()
    assert done["steps"] == 8 and done["samples_per_s"] > 0, done
    assert 0.5 < done["auc"] < 1 and 0 < done["logloss"] < 1 and done["eval_samples"] == 1000, done
    assert done["oracle_auc"] is None, "Criteo files carry no ground truth"
    assert done["skipped_lines"] == 1, done
    progress = [e for e in up.events if e["event"] == "progress"]
    assert progress and all("samples_per_s" in e for e in progress), progress
    assert done["per_step"]["seconds"]["fetch_hidden"] > 0, done["per_step"]
    checkpoints = sorted((tmp_path / "first" / "ckpt").glob("step-*"))
    assert checkpoints, "the final checkpoint"
    for trainer in ("ctr0", "ctr1"):
        # Past the held-out lines, 8 steps of both trainers' 256 lines and the malformed one; the
        # 2 batches each read ahead and never trained would put it 1,024 lines further.
        position = torch.load(checkpoints[-1] / f"{trainer}.pt", weights_only=False)
        assert position["steps"] == 8 and position["cursor"] <= 1000 + 8 * 2 * 256 + 1, position

    # Three servers now: the checkpoint of two is resharded; the trainers go on where they were.
    again = UpProcess(tmp_path / "first", *SMALL, "--data", str(data), "--steps", "2", "--num-ps", "3")
    cleanup(again)
    again.wait_event("started", 120)
    assert set(again.cluster()["sidecars"]) == {"ps0", "ps1", "ps2", "ctr0", "ctr1"}
    done = again.wait_event("done", 300)
    assert done["total_steps"] == 2 * (8 + 2), done        # the steps before the restart counted on
    logs = again.full_logs()
    assert f"resharding {checkpoints[-1].name} from 2 to 3 servers" in logs, again.logs()
    assert "resumed position from step-" in logs and "same trainers, same data" in logs, again.logs()
    assert again.proc.wait(30) == 0, again.logs()
    assert math.isfinite(done["auc"]), done


def test_a_short_sync_run_is_in_step_from_its_first_step_and_repeats_itself(tmp_path, cleanup):
    """Two trainers in sync for 8 steps: neither trains a step before the other is in, so both
    evaluate the same model, and a second run from the same seed ends where the first did, though
    it reads each step's rows ahead (``--prefetch 1``, exact in sync) where the first reads them
    in the step."""
    done = []
    for run, flags in (("first", ()), ("second", ("--prefetch", "1"))):
        up = UpProcess(tmp_path / run, *SMALL, "--consistency", "sync", "--steps", "8", "--num-ps", "2", *flags)
        cleanup(up)
        done.append(up.wait_event("done", 300))
        assert up.proc.wait(30) == 0, up.logs()
        left = re.findall(r"(ctr\d) left the step clock at step (\d+)", up.full_logs())
        assert sorted(left) == [("ctr0", "8"), ("ctr1", "8")], left
    assert [d["auc_spread"] for d in done] == [0.0, 0.0], done
    assert done[0]["auc"] == done[1]["auc"] and done[0]["logloss"] == done[1]["logloss"], done
    assert ["fetch_hidden" in d["per_step"]["seconds"] for d in done] == [False, True], "only the second read ahead"


def test_ctr_status_and_metrics_carry_quality(tmp_path, cleanup):
    # An unbounded episode, ended over HTTP: `up` then runs on, and the evaluation stays to be read
    # (with --steps, four tiny steps and their evaluation may be over before the first look).
    # With a rows cache on the trainer: 20 copies of each table or 1 % of its rows, whichever is
    # more (101 of C3's 10,131), each serving up to 3 steps.
    up = UpProcess(tmp_path, *SMALL, "--num-ps", "1", "--num-trainers", "1", "--no-final-checkpoint",
                   "--cache-rows", "20", "--cache-share", "0.01", "--cache-staleness", "3")
    cleanup(up)
    up.wait_event("started", 120)
    url = up.cluster()["sidecars"]["ctr0"]
    ps0 = up.cluster()["sidecars"]["ps0"]
    import httpx
    found, work = {}, {}
    wait_until(lambda: httpx.get(f"{url}/status", timeout=5).json().get("step", 0) >= 4, 120, "ctr0's steps")
    with SidecarClient(url, timeout=10) as c:
        c.stop_episode()

    def evaluated():
        # ps0's work as it goes: once ctr0 has evaluated, `up` may stop everyone at any moment.
        work.update(httpx.get(f"{ps0}/status", timeout=5).json().get("work") or {})
        status = httpx.get(f"{url}/status", timeout=5).json()
        if status.get("eval"):
            found.update(status=status, metrics=httpx.get(f"{url}/metrics", timeout=5).text)
            return True
        return False
    wait_until(evaluated, 180, "ctr0's evaluation on its status")
    status = found["status"]
    assert 0.5 < status["eval"]["auc"] < 1 and 0.7 < status["eval"]["oracle_auc"] < 0.9, status["eval"]
    assert any("AUC" in column for column in status["summary"]), status["summary"]
    metrics = found["metrics"]
    assert 'rpcps_trainer_eval_auc{name="ctr0",role="ctr"}' in metrics
    samples = f'rpcps_trainer_samples_total{{name="ctr0",role="ctr"}} {256.0 * status["step"]}'
    assert samples in metrics, metrics
    cache = status["cache"]
    sizes = SyntheticCtr(scale=0.001).cardinalities
    assert cache["hits"] > 0 and 0 < cache["hit_rate"] < 1, cache
    # Counted by lookups (each id as often as the batches name it): the hot ids weigh more.
    assert cache["hit_rate"] < cache["lookup_hit_rate"] < 1 and cache["lookups"] >= 26 * 256 * 4, cache
    # More copies than 20 a table could hold, no more than the share allows.
    assert sum(min(20, n) for n in sizes) < cache["rows"] <= sum(max(20, math.ceil(0.01 * n)) for n in sizes), cache
    assert 0 < cache["oldest"] <= 3 and cache["bytes_saved"] == status["moved"]["bytes_saved"] > 0, cache
    hits = f'rpcps_trainer_cache_ids_total{{name="ctr0",outcome="hit",role="ctr"}} {float(cache["hits"])}'
    assert hits in metrics, [line for line in metrics.splitlines() if "cache" in line]
    named = [line for line in metrics.splitlines() if line.startswith("rpcps_trainer_cache_lookups_total{")]
    assert sum(float(line.split()[-1]) for line in named) == cache["lookups"], named

    # Where the steps' time went: the server's rows and seconds, the trainer's messages and phases.
    def ps0_updated() -> bool:
        try:
            work.update(httpx.get(f"{ps0}/status", timeout=5).json().get("work") or {})
        except httpx.HTTPError:
            return True                  # stopped: what it said last is what it did
        return work.get("update", {}).get("rows", 0) > 0
    wait_until(ps0_updated, 30, "ps0's updates on its status")
    assert work["lookup"]["rows"] > 0 and work["lookup"]["rows_per_s"] > 0, work
    assert work["update"]["seconds"] > 0, work
    assert up.terminate(timeout=15) == 0, up.logs()
    done = up.wait_event("done", 5)
    # Each step of its one server: a lookup, the MLPs' weights, and the apply carrying the
    # gradients (the backward ran on the trainer; distributed autograd's took 6 and more).
    assert done["per_step"]["rpcs"] == 3, done["per_step"]
    assert {"fetch", "forward", "backward", "optimize", "total"} <= set(done["per_step"]["seconds"]), done
    # … and the training thread's CPU in each: the model's passes are most of it.
    cpu = done["per_step"]["cpu_seconds"]
    assert cpu["forward"] > 0 and cpu["backward"] > 0 and cpu["total"] >= cpu["forward"] + cpu["backward"], cpu
    assert 0 < done["per_step"]["cache_hit_rate"] < done["per_step"]["cache_lookup_hit_rate"] < 1, done
    assert done["bytes_per_step"]["saved"] > 0, done


def test_ctr_members_killed_at_random_and_the_leader_come_back(tmp_path, cleanup):
    # What the language model's supervision test does, on this workload with hashed tables:
    # `rpcps chaos` kills members (trainers and servers), then the leader; each comes back by
    # itself, a server with no less than the checkpoint it had (its hashed rows restored from it),
    # the other server keeps its shard across the leader's loss, and training goes on to a clean stop.
    # Every other checkpoint is a delta: servers come back from chains of them.
    up = UpProcess(tmp_path, *SMALL, *HASHED, "--checkpoint-every-steps", "20", "--full-checkpoint-every", "2",
                   "--restart-backoff", "0.25", "--restart-backoff-max", "1")
    cleanup(up)
    urls = up.wait_event("started", 120)["sidecars"]

    def step_of(name: str) -> int:
        with SidecarClient(urls[name], timeout=2.0) as c:
            return c.status().get("step", 0)
    wait_until(lambda: min(step_of("ctr0"), step_of("ctr1")) >= 25, 120, "both trainers past a checkpoint")

    # ps1 lost twice: the trainers lose a step each time, wait for it and go on, in the same processes.
    gaps = lose_server(up, "ps1", ["ctr0", "ctr1"])
    print("ps1 back -> the trainers' next step: " + ", ".join(f"{g:.2f}s" for g in gaps))

    def chaos(*flags: str) -> list[dict]:
        done = subprocess.run([sys.executable, "-m", "supervise.cli", "chaos", "--json", "--state-dir",
                               str(up.state_dir), "--interval", "0.2", *flags], capture_output=True, text=True,
                              timeout=400)
        assert done.returncode == 0, done.stdout + done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]

    kills = [e for e in chaos("--kills", "4", "--seed", "3") + chaos("--kills", "1", "--members", "ps0")
             if e["event"] == "kill"]
    assert len(kills) == 5 and all(k["back_at"] for k in kills), kills
    assert {k["member"] for k in kills} & {"ctr0", "ctr1"}, kills      # the seed kills trainers too
    for k in kills:
        print(f"chaos: {k['member']} back in {k['seconds']}s, resumed from {k['resumed_from']}, "
              f"{k['steps_lost']} steps lost")
        if k["member"].startswith("ps") and k["checkpoint_at_kill"]:
            assert k["resumed_step"] >= int(k["checkpoint_at_kill"].split("-")[1]), k
    assert kills[-1]["kept_by"] == ["ps1"], kills[-1]
    leader_lost = {e["name"] for e in up.drain() if e["event"] == "restart" and e["exit_code"] == 75}
    # A trainer that had lost servers before may die inside torch instead of leaving (docs/limits.md).
    assert "ps1" in leader_lost <= {"ctr0", "ctr1", "ps1"}, leader_lost

    after = step_of("ctr0")
    wait_until(lambda: step_of("ctr0") > after + 5, 90, "ctr0 training after the chaos")
    assert up.terminate(timeout=15) == 0, up.logs()
    done = up.wait_event("done", 5)
    assert done["restarts"] >= 5 + 3, done
