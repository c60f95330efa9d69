"""The examples as their READMEs run them, briefly: each model on real servers, one also in one
process; each checkpoint exported and loaded without servers, scoring as the cluster did (and, for
one, served over HTTP by `rpcps serve`, answering as the loaded model); and the user-code line
counts their READMEs state are the files' own."""
import csv
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

import rpcps
from rpcps.quality import auc, logloss
from tests.support.cluster import REPO

EXAMPLES = REPO / "examples"
# (folder, model, schema, the data writer's arguments)
CASES = [("criteo_dlrm", "criteo_dlrm.model:DLRM", "criteo.yaml", ["ctr", "--rows", "1500", "--scale", "0.01"]),
         ("movies_deepfm", "movies_deepfm.model:DeepFM", "movies.yaml", ["ratings", "--rows", "1500"])]


def cli(cwd, *args):
    return subprocess.run([sys.executable, "-m", "supervise.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(REPO)])})


def served_scores(procs, tmp_path, schema):
    """The held-out lines' scores from `rpcps serve` over the exported folder, the lines sent as a
    client sends JSON rows (numbers as numbers), 50 to a request, 3 requests at a time."""
    serve = procs.start_rl("serve", "serve0", {**os.environ, "PYTHONPATH": f"{EXAMPLES}{os.pathsep}{REPO}"},
                           snapshot=tmp_path / "model")
    procs.wait_ready(serve)
    numeric = set(schema.numeric_names)
    path = sorted((tmp_path / "data").iterdir())[0]
    with path.open(newline="") as f:
        lines = [{k: (float(v) if v else None) if k in numeric else v for k, v in row.items()}
                 for _, row in zip(range(300), csv.DictReader(f))]
    with httpx.Client(base_url=serve.url, timeout=30) as client, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda k: client.post("/predict", json={"rows": lines[k:k + 50]}), range(0, 300, 50)))
    assert all(a.status_code == 200 for a in answers), answers[0].text
    assert answers[0].headers["x-rpcps-served"] == "snapshot step-3"
    return np.array([p for a in answers for p in a.json()["predictions"]])


@pytest.mark.parametrize("folder,model,schema,data", CASES)
def test_an_example_trains_on_servers_as_its_readme_says(tmp_path, monkeypatch, procs, folder, model, schema, data):
    lines = {name: len((EXAMPLES / folder / name).read_text().splitlines()) for name in ("model.py", schema)}
    readme = (EXAMPLES / folder / "README.md").read_text()
    for name, count in lines.items():
        assert f"`{name}` ({count} lines)" in readme, f"{folder}/README.md: {name} has {count} lines"
    total = sum(lines.values())
    assert f"{total} lines of user code" in readme and total <= 80, total
    assert re.search(rf"\[{folder}\]\({folder}/\) \| .* \| {total} lines \|", (EXAMPLES / "README.md").read_text())

    made = cli(tmp_path, "data", *data, "--out", str(tmp_path / "data"))
    assert made.returncode == 0, made.stderr
    checked = cli(tmp_path, "data", "check", "--schema", str(EXAMPLES / folder / schema), "--data",
                  str(tmp_path / "data"), "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tables = json.loads(checked.stdout)["tables"]      # every value a row of its own
    assert all(t["sharing"] == 0 and t["rows_used"] == t["distinct"] > 0 for t in tables), tables
    flags = ["--workload", "ctr", "--model", model, "--schema", str(EXAMPLES / folder / schema), "--data",
             str(tmp_path / "data"), "--steps", "3", "--batch-size", "64", "--eval-samples", "300", "--json"]
    up = cli(tmp_path, "up", *flags, "--num-ps", "2", "--num-trainers", "1", "--checkpoint-dir", str(tmp_path / "ck"),
             "--state-dir", str(tmp_path / "state"))
    assert up.returncode == 0, up.stderr[-3000:]
    done = [json.loads(line) for line in up.stdout.splitlines() if '"done"' in line][-1]
    assert done["steps"] == 3 and 0 < done["auc"] < 1 and done["eval_samples"] == 300, done

    # Taken out: the checkpoint of 2 servers exported, loaded where no server runs, scores the
    # held-out lines (the files' first 300) as the cluster's own evaluation did.
    # No --data: `up` measured the standardized columns once, on training lines, and the servers
    # hosted the schema with them, so the checkpoint holds what serving needs.
    exported = cli(tmp_path, "export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "model"))
    assert exported.returncode == 0, exported.stderr
    monkeypatch.syspath_prepend(str(EXAMPLES))
    model = rpcps.load_model(tmp_path / "model")
    scores, labels = [], []
    with torch.no_grad():
        for b in rpcps.batches(model.schema, tmp_path / "data", 128, limit=300):
            scores.append(torch.sigmoid(model(b)).numpy())
            labels.append(b.labels.numpy())
    scores, labels = np.concatenate(scores), np.concatenate(labels)
    assert len(labels) == 300
    assert abs(auc(scores, labels) - done["auc"]) < 1e-6 and abs(logloss(scores, labels) - done["logloss"]) < 1e-6, \
        (auc(scores, labels), logloss(scores, labels), done)
    if folder == "movies_deepfm":
        served = served_scores(procs, tmp_path, model.schema)
        assert np.abs(served - scores).max() < 1e-6, np.abs(served - scores).max()
        local = cli(tmp_path, "up", *flags, "--local")
        assert local.returncode == 0, local.stderr[-3000:]
        done = [json.loads(line) for line in local.stdout.splitlines() if '"done"' in line][-1]
        assert done["local"] and done["steps"] == 3 and 0 < done["auc"] < 1, done
        # Its CPU a step by phase, named as a trainer's, for the benchmarks to set side by side.
        cpu = done["per_step"]["cpu_seconds"]
        assert {"batch", "forward", "backward", "update", "total"} == set(cpu) and cpu["backward"] > 0, done


def test_the_movies_example_trains_on_two_trainers_from_parquet_written_as_most_users_write_it(tmp_path):
    # The CSV converted as most users would (pyarrow's read_csv, then write_table: one row group),
    # the schema's format the only change; two trainers in sync mode. Each trainer's share is the
    # same records in either format, so the runs agree (the servers may sum a step's two gradients
    # in either order: within 0.002 AUC, as asked).
    import pyarrow.csv
    import pyarrow.parquet
    made = cli(tmp_path, "data", "ratings", "--rows", "3000", "--out", str(tmp_path / "csv"))
    assert made.returncode == 0, made.stderr
    (tmp_path / "parquet").mkdir()
    written = tmp_path / "parquet" / "part_0.parquet"
    pyarrow.parquet.write_table(pyarrow.csv.read_csv(tmp_path / "csv" / "part_0.csv"), written)
    assert pyarrow.parquet.ParquetFile(written).metadata.num_row_groups == 1
    schema = tmp_path / "movies.yaml"
    schema.write_text((EXAMPLES / "movies_deepfm" / "movies.yaml").read_text().replace("format: csv",
                                                                                        "format: parquet"))
    found = {}
    for fmt, schema_file in (("csv", EXAMPLES / "movies_deepfm" / "movies.yaml"), ("parquet", schema)):
        up = cli(tmp_path, "up", "--workload", "ctr", "--model", "movies_deepfm.model:DeepFM", "--schema",
                 str(schema_file), "--data", str(tmp_path / fmt), "--steps", "6", "--batch-size", "128",
                 "--eval-samples", "500", "--num-ps", "2", "--num-trainers", "2", "--consistency", "sync", "--json",
                 "--state-dir", str(tmp_path / f"state-{fmt}"), "--checkpoint-dir", str(tmp_path / f"ck-{fmt}"))
        assert up.returncode == 0, up.stderr[-3000:]
        found[fmt] = [json.loads(line) for line in up.stdout.splitlines() if '"done"' in line][-1]
    csv_done, parquet_done = found["csv"], found["parquet"]
    assert csv_done["total_steps"] == parquet_done["total_steps"] == 12 and csv_done["eval_samples"] == 500, found
    assert parquet_done["loss_first"] == csv_done["loss_first"], found      # the same first batches
    assert 0.5 < csv_done["auc"] < 1, csv_done
    assert abs(parquet_done["auc"] - csv_done["auc"]) <= 0.002, found
