"""Hashed tables as a user runs them: `rpcps up --workload ctr --tables hashed` keys every table
by raw 64-bit ids within a capacity, admits ids seen twice, evicts what went cold; the servers
show it on /status and in their metrics; the checkpoint, a delta on a full one, restores on another
server count. The rows are stored and sent in fp16, and the restore widens them to bf16 storage; the
trainers run in ssp mode, and after the restore in sync mode (the chaos test runs hashed tables in
async mode)."""
import json
import math
import subprocess
import sys

import httpx
import torch

from tests.integration.test_ctr_up import HASHED, SMALL
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until



def hashed_status(url: str) -> dict:
    return httpx.get(f"{url}/status", timeout=5).json().get("hashed") or {}


def test_hashed_tables_admit_evict_show_and_reshard(tmp_path, cleanup):
    # Every checkpoint after the first a delta; the trainers slowed down (--jitter), so that a
    # periodic checkpoint comes before the final one however fast the machine is.
    up = UpProcess(tmp_path, *SMALL, *HASHED, "--steps", "8", "--num-ps", "2", "--checkpoint-every-steps", "4",
                   "--full-checkpoint-every", "100", "--table-dtype", "fp16", "--wire-dtype", "fp16",
                   "--consistency", "ssp:2", "--jitter", "5", "--jitter-fraction", "1")
    cleanup(up)
    urls = up.wait_event("started", 120)["sidecars"]
    seen: dict[str, dict] = {}

    def evicting() -> bool:
        seen.update({n: hashed_status(urls[n]) for n in ("ps0", "ps1")})
        return all(sum(t["evicted"] for t in s.values()) > 0 for s in seen.values())
    wait_until(evicting, 180, "both servers evicting")
    for name, tables in seen.items():
        assert len(tables) == 26, tables.keys()
        for table, t in tables.items():
            assert t["rows"] <= t["capacity"] <= 150, (name, table, t)     # 300 rows over 2 servers
        assert sum(t["admitted"] for t in tables.values()) > 0 and sum(t["dropped"] for t in tables.values()) > 0
    metrics = httpx.get(f"{urls['ps0']}/metrics", timeout=5).text
    assert 'rpcps_ps_hashed_rows{name="ps0",role="ps",table="C1"}' in metrics, metrics[-2000:]
    assert "rpcps_ps_hashed_evicted_total" in metrics
    done = up.wait_event("done", 300)
    assert up.proc.wait(30) == 0, up.logs()
    assert math.isfinite(done["auc"]) and 0.4 < done["auc"] < 1, done
    saved = sorted((tmp_path / "ckpt").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert saved, "the final checkpoint"
    listed = json.loads(subprocess.run([sys.executable, "-m", "supervise.cli", "checkpoint", "--list", "--json",
                                        "--verify", "--checkpoint-dir", str(tmp_path / "ckpt")],
                                       capture_output=True, text=True, timeout=60, check=True).stdout)["checkpoints"]
    kinds = {c["id"]: (c["kind"], c.get("bases")) for c in listed}
    assert kinds[saved[-1].name][0] == "delta" and all(c["state"] == "verified" for c in listed), listed
    base = kinds[saved[-1].name][1][0]
    while kinds[base][0] == "delta":
        base = kinds[base][1][0]
    assert kinds[base][0] == "full", kinds
    shard = torch.load(saved[-1] / "ps0.pt", weights_only=True)
    assert {p.dtype for n, p in shard["params"].items() if n.startswith("tables.")} == {torch.float16}, "tables"
    assert {s.dtype for st in shard["optim"].values() for s in st.values()} <= {torch.float32}

    # Three servers: each takes the ids it owns of every old shard's saved rows.
    again = UpProcess(tmp_path, *SMALL, *HASHED, "--steps", "2", "--num-ps", "3", "--table-dtype", "bf16",
                      "--consistency", "sync")
    cleanup(again)
    urls = again.wait_event("started", 120)["sidecars"]
    restored = {n: hashed_status(urls[n]) for n in ("ps0", "ps1", "ps2")}
    assert all(sum(t["rows"] for t in s.values()) > 0 for s in restored.values()), restored
    assert f"resharding {saved[-1].name} from 2 to 3 servers" in again.full_logs(), again.logs()
    again.wait_event("done", 300)
    assert again.proc.wait(30) == 0, again.logs()
