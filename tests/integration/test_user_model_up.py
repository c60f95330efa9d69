"""A user's model and schema, defined only under tests/, as a user runs them: `rpcps data ratings`
writes CSV files, `rpcps data check` shows them as the schema reads them, a wrong schema is refused
with its file and key, `rpcps up --model … --schema … --data …` trains the model on real servers (a
malformed line skipped and counted, held-out AUC reported), and a restart on another server count
resumes from its checkpoint, resharded."""
import json
import math
import os
import subprocess
import sys

from tests.support.cluster import REPO
from tests.support.upcli import UpProcess

SCHEMA = REPO / "tests" / "support" / "ratings_schema.yaml"
MODEL = ["--workload", "ctr", "--model", "tests.support.ratings_model:RatingsModel", "--schema", str(SCHEMA),
         "--batch-size", "128", "--eval-samples", "500", "--progress-interval", "1"]
ENV = {"PYTHONPATH": str(REPO)}


def cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "supervise.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, **ENV})


def test_a_users_model_and_schema_train_check_and_resume_resharded(tmp_path, cleanup):
    data = tmp_path / "data"
    made = cli(tmp_path, "data", "ratings", "--rows", "3000", "--out", str(data))
    assert made.returncode == 0, made.stderr
    with open(data / "part_0.csv", "a") as f:      # past the 500 held-out lines: read in training
        f.write("1,7,12,Comedy|Drama|War|Horror,M,3,not-a-number,1990\n")

    checked = cli(tmp_path, "data", "check", "--schema", str(SCHEMA), "--data", str(data), "--json")
    assert checked.returncode == 1, checked.stderr
    seen = json.loads(checked.stdout)
    assert seen["lines"] == 3001 and seen["malformed"] == 1, seen
    assert seen["reasons"] == [f"{data / 'part_0.csv'}:3002: column age is not a number: 'not-a-number'"], seen
    genres = next(c for c in seen["categorical"] if c["feature"] == "genres")
    assert genres["max_length"] == 3 and 0 < genres["truncated_rate"] < 1 and genres["distinct"] == 18, genres
    age = next(n for n in seen["numeric"] if n["column"] == "age")
    assert age["standardized_by"]["measured"] and 1 <= age["min"] <= age["mean"] <= age["max"] <= 56, age
    # The tables `rpcps up` warns of (the same rule: test_preflight), with its words.
    advised = {t["table"]: t["advice"] for t in seen["tables"] if t["advice"]}
    assert sorted(advised) == ["genre", "movie", "occupation"], advised
    assert "make it `hashed: true`" in advised["movie"] and "give it more rows" in advised["genre"], advised
    short = cli(tmp_path, "data", "check", "--schema", str(SCHEMA), "--data", str(data), "--num-trainers", "3000",
                "--eval-samples", "500")
    assert short.returncode == 2 and "--data has 2501 records to train on after the 500 held out, fewer than the " \
        "3000 trainers" in short.stderr, short.stderr
    # Its reader gone (`| head`): no traceback.
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as closed:
        gone = subprocess.run([sys.executable, "-m", "supervise.cli", "data", "check", "--schema", str(SCHEMA),
                               "--data", str(data)], stdout=closed, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=tmp_path, env={**os.environ, **ENV})
    assert gone.returncode == 1 and "Traceback" not in gone.stderr, gone.stderr

    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(SCHEMA.read_text().replace("table: genre,", "table: genres,"))
    refused = cli(tmp_path, "up", *MODEL[:4], "--schema", str(wrong), "--data", str(data), "--steps", "2")
    assert refused.returncode == 2, refused.stderr
    assert f"{wrong}: categorical: feature genres uses table genres, which `tables` does not declare" \
        in refused.stderr, refused.stderr

    up = UpProcess(tmp_path / "first", *MODEL, "--data", str(data), "--steps", "12", "--num-ps", "2", env=ENV)
    cleanup(up)
    up.wait_event("started", 120)
    done = up.wait_event("done", 300)
    assert up.proc.wait(30) == 0, up.logs()
    assert done["steps"] == 12 and done["samples_per_s"] > 0, done
    assert 0.5 < done["auc"] < 1 and 0 < done["logloss"] < 1 and done["eval_samples"] == 500, done
    assert done["skipped_lines"] == 1, done
    # The age column, standardized without a mean and std in the schema: measured once by `up` on
    # the training lines (after the 500 held out), every member given the schema with them.
    recorded = (up.state_dir / "schema.yaml").read_text()
    assert f"as rpcps up read {data}'s training lines" in recorded, recorded
    assert "# age measured on data lines 500 to 10500: mean " in recorded, recorded
    assert "column age standardized by the mean" not in up.full_logs(), "no member measured it again"
    assert done["truncated_lists"] > 0, "genre lists of 3 cut to the schema's 2"
    checkpoints = sorted((tmp_path / "first" / "ckpt").glob("step-*"))
    assert checkpoints, "the final checkpoint"

    again = UpProcess(tmp_path / "first", *MODEL, "--data", str(data), "--steps", "2", "--num-ps", "3", env=ENV)
    cleanup(again)
    again.wait_event("started", 120)
    done = again.wait_event("done", 300)
    assert done["total_steps"] == 2 * (12 + 2), done
    assert not [e for e in up.events if e["event"] == "resuming"], "the first run started fresh"
    resuming = [e for e in again.events if e["event"] == "resuming"]
    assert [e["checkpoint"] for e in resuming] == [checkpoints[-1].name] and not resuming[0]["given"], resuming
    logs = again.full_logs()
    assert f"resharding {checkpoints[-1].name} from 2 to 3 servers" in logs, again.logs()
    assert "same trainers, same data" in logs, again.logs()
    assert again.proc.wait(30) == 0, again.logs()
    assert math.isfinite(done["auc"]), done


def test_a_model_in_the_working_folder_runs_locally_and_a_broken_one_stops_up_before_any_member(tmp_path):
    """As a user runs it: the model file beside the data, no PYTHONPATH set, `--model` naming the
    CTR workload alone."""
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda *args: subprocess.run([sys.executable, "-m", "supervise.cli", *args], capture_output=True, text=True,
                                       timeout=120, cwd=tmp_path, env=env)
    assert run("data", "ratings", "--rows", "1200", "--out", str(data)).returncode == 0
    assert run("data", "ratings", "--rows", "300", "--seed", "2", "--out", "held").returncode == 0
    (tmp_path / "mymodel.py").write_text((REPO / "tests" / "support" / "ratings_model.py").read_text())
    local = run("up", "--local", "--model", "mymodel:RatingsModel", "--schema", str(SCHEMA), "--data", "data",
                "--eval-data", "held", "--steps", "2", "--batch-size", "64", "--eval-samples", "200", "--json")
    assert local.returncode == 0, local.stderr
    done = json.loads(local.stdout.splitlines()[-1])
    assert done["event"] == "done" and math.isfinite(done["auc"]) and done["eval_samples"] == 200, done

    (tmp_path / "broken.py").write_text(
        "import torch.nn as nn\nclass M(nn.Module):\n    def __init__(self, schema):\n        super().__init__()\n"
        "    def forward(self, batch):\n        return batch.dense.sum()\n")
    refused = run("up", "--model", "broken:M", "--schema", str(SCHEMA), "--data", "data", "--eval-samples", "200",
                  "--steps", "2", "--state-dir", "state")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "rpcps up: --model broken:M: its forward over 64 samples gave a tensor of shape [] (torch.float32); it must "
        "give a logit a sample, a float tensor of shape [64]"), refused.stderr
    assert not (tmp_path / "state" / "logs").exists(), "no member started"
