"""`rpcps up --dense allreduce` as a user runs it: refused with async; with sync it trains with the
LSTM replicated on the trainers, a killed trainer leaves the others training and its replacement
joins them, and a checkpoint holds the replica's weights once, in the server shards, where
`--dense ps` resumes from them."""
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import torch

from services.client import SidecarClient
from tests.support.replicas import GROUP_TIMEOUT, RESTART_LATER, kill_one_and_see_it_rejoin
from tests.support.upcli import UpProcess
from trainer.lm.config import LmModelConfig
from trainer.lm.model import init_lstm_layer

TINY = ["--emsize", "16", "--nhid", "16", "--batch-size", "4", "--bptt", "5", "--synthetic-tokens", "5000",
        "--progress-interval", "1"]


def test_allreduce_needs_sync_or_hybrid_and_says_so(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supervise.cli", "up", "--dense", "allreduce", *TINY],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert "--consistency async keeps the dense weights on the servers" in r.stderr, r.stderr
    assert "need --consistency sync or hybrid" in r.stderr, r.stderr


def lstm_of(folder) -> dict[str, torch.Tensor]:
    out = {}
    for shard in ("ps0", "ps1"):
        state = torch.load(folder / f"{shard}.pt", weights_only=True)
        out.update({k: v for k, v in state["params"].items() if "_l" in k})
    return out


def digest_of(lstm: dict[str, torch.Tensor]) -> str:
    """As a trainer's /status digests its replica."""
    h = hashlib.sha256()
    for _, t in sorted(lstm.items()):
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def test_a_killed_trainer_leaves_the_others_training_with_equal_replicas_and_its_replacement_joins(tmp_path, cleanup):
    # Six: the replicas sum by halving and doubling (trainer/core/allreduce.py); the five
    # survivors by gloo's ring, until the replacement makes six again.
    trainers = [f"trainer{i}" for i in range(6)]
    up = UpProcess(tmp_path, "--dense", "allreduce", "--consistency", "sync", "--trainers", "6",
                   *RESTART_LATER, *TINY, env=GROUP_TIMEOUT)
    cleanup(up)
    urls = up.wait_event("started", 120)["sidecars"]
    kill_one_and_see_it_rejoin(up, urls, trainers, "trainer1")
    logs = up.full_logs()
    assert re.search(rf"forming the trainers' process group \S+: rank 1 of 6 \({', '.join(trainers)}\)", logs)

    # A checkpoint holds the replica once, in the server shards, bit for bit as the trainers hold it.
    with SidecarClient(urls["trainer0"], timeout=120.0) as c:
        taken = c.checkpoint()
        replica = c.status()["dense_replica"]
    step = taken["step"]
    saved = lstm_of(Path(taken["path"]))
    assert digest_of(saved) == dict(replica["digests"])[step]
    assert up.terminate() == 0

    # The newest checkpoint (the one taken at the stop) resumes with the LSTM back on the servers
    # (--dense ps), from the replica's weights; and that run's, in --dense allreduce again, from
    # the servers' weights.
    folder = Path(taken["path"]).parent
    model = LmModelConfig(ntoken=1000, emsize=16, nhid=16)
    initial = {k: v for layer in range(2) for k, v in init_lstm_layer(model, layer).items()}
    for mode in (["--dense", "ps"], ["--dense", "allreduce"]):
        saved, resumed = one_step_on(folder, tmp_path, cleanup, mode)
        moved = max(float((resumed[k] - saved[k]).abs().max()) for k in saved)
        trained = max(float((saved[k] - initial[k]).abs().max()) for k in saved)
        # At --lr 1e-6 a step moves no weight by more than 1e-6 (its clipped norm is at most
        # 0.25e-6): the step began from the checkpoint's LSTM, not from any other.
        assert moved <= 1e-6 < trained, f"{mode}: a step from the checkpoint moved its LSTM by {moved}"


def one_step_on(folder: Path, tmp_path: Path, cleanup, mode: list[str]):
    """The LSTM of the newest checkpoint in ``folder``, and of the one after a sync step (at a
    tiny learning rate) resumed from it in ``mode``."""
    def newest() -> Path:
        return max(folder.glob("step-*"), key=lambda p: int(p.name.removeprefix("step-")))
    last = newest()
    run = UpProcess(tmp_path, "--consistency", "sync", "--steps", "1", "--lr", "1e-6", *mode, *TINY)
    cleanup(run)
    run.wait_event("done", 120)
    assert run.proc.wait(30) == 0, run.logs()
    assert f"resuming from {last.name}" in run.full_logs()
    assert newest() != last
    return lstm_of(last), lstm_of(newest())
