"""The leader (ps0) killed with SIGKILL, twice: the other server hands its shard over and keeps it,
ps0 comes back from its last checkpoint, and training goes on. The hammer steps' gradients do not
depend on the parameters, so what each shard must hold afterwards is known to the bit: ps1 every
update it applied, ps0 those up to its checkpoint."""
import os
import signal

import torch

from services.leader import LEADER_LOST
from tests.integration.test_concurrent_updates import replay
from tests.support.cluster import SMALL_MODEL
from tests.support.wait import wait_until
from trainer.lm.config import LmModelConfig as ModelConfig

MODEL = {**SMALL_MODEL, "lr": 0.125, "optimizer": "sgd"}


def lose_leader(procs, ps0, ps1):
    """SIGKILL ps0; ps1 must leave by itself with LEADER_LOST; then start both again, as a supervisor would."""
    os.kill(ps0.proc.pid, signal.SIGKILL)
    ps0.proc.wait(10)
    code = wait_until(lambda: ps1.proc.poll(), 30, "ps1 to leave after losing its leader")
    assert code == LEADER_LOST, ps1.log_text()[-3000:]
    assert "handed over this shard" in ps1.log_text()
    new = [procs.start("ps", name, 2, **MODEL) for name in ("ps0", "ps1")]
    for role in new:
        procs.wait_ready(role)
    return new


def shard_equals(state: dict, expected: dict) -> dict:
    """Elements of each of ``state``'s parameters that differ from the full model ``expected``."""
    rows = next(iter(state["tables"].values()))
    out = {}
    for name, value in state["params"].items():
        full = expected[name] if name in expected else expected[f"lstm.{name}"]   # the LSTM's layers, whole
        want = full if full.shape == value.shape else full[rows]
        out[name] = int((value != want).sum())
    return out


def steps_of(server) -> int:
    with server.client() as c:
        return c.status()["steps"]


def checkpoint_shards(ps0, tmp_path) -> tuple[int, dict, dict]:
    with ps0.client(timeout=60.0) as c:
        taken = c.checkpoint()
    folder = tmp_path / "ckpt" / taken["id"]
    load = lambda name: torch.load(folder / f"{name}.pt", weights_only=True)  # noqa: E731
    return taken["step"], load("ps0"), load("ps1")


def test_leader_sigkill_twice_keeps_every_other_shard(procs, tmp_path):
    config = ModelConfig(**MODEL)
    ps0, ps1 = procs.start_servers(2, **MODEL)
    procs.run_driver("hammer", "trainer0", 2, steps=3)
    with ps0.client(timeout=60.0) as c:
        assert c.checkpoint()["step"] == 3
    procs.run_driver("hammer", "trainer0", 2, steps=4)     # 7 on both; ps0's last 4 die with it

    ps0, ps1 = lose_leader(procs, ps0, ps1)
    with ps1.client() as c:
        kept = c.status()["resumed_from"]
    assert kept["handover"] and kept["updates_kept"] == 4 and kept["id"] == "step-3", kept
    # Steps count on from the furthest server, so this checkpoint is a new one.
    step, s0, s1 = checkpoint_shards(ps0, tmp_path)
    assert step == 7
    assert sum(shard_equals(s0, replay(config, 3)).values()) == 0, "ps0 is back at its checkpoint"
    assert sum(shard_equals(s1, replay(config, 7)).values()) == 0, "ps1 kept every update"

    procs.run_driver("hammer", "trainer0", 2, steps=2)     # training goes on: ps0 5 updates, ps1 9
    ps0, ps1 = lose_leader(procs, ps0, ps1)                 # the second time, ps0 comes back from step-7
    step, s0, s1 = checkpoint_shards(ps0, tmp_path)
    assert step == 9
    assert sum(shard_equals(s0, replay(config, 3)).values()) == 0
    assert sum(shard_equals(s1, replay(config, 9)).values()) == 0

    procs.run_driver("hammer", "trainer0", 2, steps=1)
    for server in (ps0, ps1):     # /status is refreshed once a second
        wait_until(lambda: steps_of(server) == 10, 10, f"{server.name} at step 10")
    assert not (tmp_path / "ckpt" / "handover" / "ps1").exists(), "a handover is used once"
