"""`rpcps up --dense allreduce` as a user runs it: refused with async, and with sync it trains with
the LSTM replicated on the trainers; a checkpoint holds the replica's weights once, in the server
shards (where either dense mode starts from them)."""
import subprocess
import sys

import torch

from tests.support.upcli import UpProcess
from trainer.lm.config import LmModelConfig
from trainer.lm.model import init_lstm_layer

TINY = ["--emsize", "16", "--nhid", "16", "--batch-size", "4", "--bptt", "5", "--synthetic-tokens", "5000",
        "--progress-interval", "1"]


def test_allreduce_needs_sync_and_says_so(tmp_path):
    r = subprocess.run([sys.executable, "-m", "services.cli", "up", "--dense", "allreduce", *TINY],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert "--dense allreduce updates synchronously" in r.stderr and "use --consistency sync" in r.stderr


def lstm_of(folder) -> dict[str, torch.Tensor]:
    out = {}
    for shard in ("ps0", "ps1"):
        state = torch.load(folder / f"{shard}.pt", weights_only=True)
        out.update({k: v for k, v in state["params"].items() if "_l" in k})
    return out


def test_allreduce_trains_and_checkpoints_hold_the_replica(tmp_path, cleanup):
    up = UpProcess(tmp_path, "--dense", "allreduce", "--consistency", "sync", "--steps", "6", *TINY)
    cleanup(up)
    done = up.wait_event("done", 180)
    assert up.proc.wait(30) == 0, up.logs()
    assert done["steps"] == 6 and done["val_loss"] > 0
    assert "forming the trainers' process group: rank 1 of 2" in up.full_logs()

    model = LmModelConfig(ntoken=1000, emsize=16, nhid=16)
    initial = {k: v for layer in range(2) for k, v in init_lstm_layer(model, layer).items()}
    final = lstm_of(tmp_path / "ckpt" / "step-6")
    assert set(final) == set(initial)
    for name, value in initial.items():
        # The servers never train their LSTM in this mode: what moved it is the replica, written
        # at the checkpoint.
        assert not torch.equal(final[name], value), f"{name} in the final checkpoint is the initial value"
