"""`rpcps up --workload ctr --consistency sync --dense allreduce --cache-rows N --cache-staleness 0`
as a user runs it: the trainers replicate the hot rows, take them instead of reading them, and
end where the same run without them ends, bit for bit: its held-out evaluation (which reads the
hot rows from the replica) and the final checkpoint (which the trainers gave the rows back to).
In hybrid (the rows async, the MLPs and hot rows replicated) a trainer killed leaves the others
training with equal replicas and hot rows, and its replacement takes them."""
import httpx
import torch

from tests.support.replicas import GROUP_TIMEOUT, RESTART_LATER, kill_one_and_see_it_rejoin
from tests.support.upcli import UpProcess

TINY = ["--workload", "ctr", "--scale", "0.001", "--dim", "8", "--bottom", "32", "--top", "32", "--batch-size", "256",
        "--eval-samples", "1000", "--progress-interval", "1"]
SMALL = [*TINY, "--consistency", "sync", "--dense", "allreduce"]
HOT = ["--cache-rows", "20", "--cache-staleness", "0"]


def run(tmp_path, cleanup, *extra):
    up = UpProcess(tmp_path, *SMALL, "--steps", "45", *extra)
    cleanup(up)
    done = up.wait_event("done", 240)
    assert up.proc.wait(60) == 0, up.logs()
    newest = max((tmp_path / "ckpt").glob("step-*"), key=lambda p: int(p.name.removeprefix("step-")))
    tables = {}
    for shard in ("ps0", "ps1"):
        state = torch.load(newest / f"{shard}.pt", weights_only=True)
        tables.update({f"{shard}/{k}": v for k, v in state["params"].items()})
        tables.update({f"{shard}/{k}/{s}": v for k, kept in state["optim"].items() for s, v in kept.items()
                       if isinstance(v, torch.Tensor)})
    return done, tables, up.full_logs()


def test_hot_rows_replicated_end_where_rows_read_from_the_servers_end(tmp_path, cleanup):
    plain, plain_tables, _ = run(tmp_path / "plain", cleanup)
    hot, hot_tables, logs = run(tmp_path / "hot", cleanup, *HOT)
    assert "hot rows at step 40" in logs, "chosen at steps 20 and 40"
    assert 0 < hot["per_step"]["cache_hit_rate"] < hot["per_step"]["cache_lookup_hit_rate"], hot["per_step"]
    assert hot["bytes_per_step"]["saved"] > 0 and hot["bytes_per_step"]["rpc"] < plain["bytes_per_step"]["rpc"]
    for key in ("loss_last", "auc", "logloss"):
        assert hot[key] == plain[key], (key, hot[key], plain[key])
    assert hot_tables.keys() == plain_tables.keys()
    differ = [k for k in plain_tables if not torch.equal(plain_tables[k], hot_tables[k])]
    assert not differ, f"the final checkpoints differ in {differ}"


def test_hybrid_a_killed_trainer_leaves_the_others_equal_replicas_and_its_replacement_takes_them(tmp_path, cleanup):
    up = UpProcess(tmp_path, *TINY, "--consistency", "hybrid", *HOT, "--num-trainers", "3", "--no-final-checkpoint",
                   *RESTART_LATER, env=GROUP_TIMEOUT)
    cleanup(up)
    urls = up.wait_event("started", 120)["sidecars"]

    def holding(names):       # the replicas' digests cover their hot rows: equal digests, equal rows
        return all(httpx.get(f"{urls[n]}/status", timeout=5).json().get("cache", {}).get("rows", 0) > 0
                   for n in names)
    kill_one_and_see_it_rejoin(up, urls, ["ctr0", "ctr1", "ctr2"], "ctr1", ready=holding)
    assert up.terminate() == 0
