"""Trainers launched by the real torchrun, against servers started alone: named and counted by
torchrun's RANK and WORLD_SIZE, each on its own share and sidecar port, reaching the servers at
--ps-addr while torchrun's MASTER_ADDR/MASTER_PORT stay its own, where their process group meets
(--dense allreduce) and sum their held-out evaluation; the job ends with the episode."""
import re
import subprocess

from supervise.processes import free_port
from services.torchrun import command as torchrun_command
from tests.support.cluster import REPO, SMALL_MODEL, Role
from tests.support.wait import wait_until

MODEL = {**SMALL_MODEL, "ntoken": 1000}  # the built-in corpus has 1000 word types
STEPS = 3


def test_torchrun_launches_trainers_that_train_against_the_servers(procs, tmp_path):
    ps0, ps1 = procs.start_servers(2, consistency="sync", **MODEL)
    sidecar = free_port(2)       # worker k's sidecar listens at sidecar + k
    log = tmp_path / "torchrun.log"
    argv = [*torchrun_command(), "--standalone", "--nproc-per-node", "2", "-m", "trainer",
            "--num-ps", "2", "--ps-addr", f"127.0.0.1:{procs.master_port}", "--steps", str(STEPS), "--dense", "allreduce",
            "--sidecar-port", str(sidecar), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--batch-size", "4", "--bptt", "5", "--synthetic-tokens", "5000"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    procs.roles.append(Role("torchrun", proc, None, log))
    assert proc.wait(timeout=180) == 0, log.read_text(errors="replace")[-4000:]

    text = log.read_text(errors="replace")
    for rank in (0, 1):
        assert f"trainer{rank} INFO trainer.lm.role: data: synthetic corpus (5000 tokens, seed 1111); " \
               f"share {rank} of 2" in text
        assert f"trainer{rank} INFO services.http_server: sidecar listening on http://127.0.0.1:{sidecar + rank}" in text
        assert f"trainer{rank} INFO trainer.core.episodes: episode 1 done after {STEPS} steps" in text
        assert f"trainer{rank} INFO trainer.core.role: the trainers' process groups meet at torchrun's store" in text
    # Evaluation: each trainer its share, then the whole split's by all_reduce over their group,
    # the same on both, and the token-weighted mean of the shares.
    shares = [(float(loss), int(tokens)) for loss, tokens in
              re.findall(r"held-out share: loss ([\d.]+) ppl [\d.]+ over (\d+) tokens", text)]
    whole = set(re.findall(r"held-out, every trainer's share \(all_reduce\): loss ([\d.]+) ppl [\d.]+ over (\d+) "
                           r"tokens", text))
    assert len(shares) == 2 and len(whole) == 1, text[-4000:]
    loss, tokens = whole.pop()
    assert int(tokens) == sum(t for _, t in shares)
    assert abs(float(loss) - sum(lo * t for lo, t in shares) / int(tokens)) < 1e-3
    # Synchronous updates: the two trainers' step k is one update on each server (whose status
    # shows its count within a second).
    for server in (ps0, ps1):
        with server.client(timeout=5.0) as c:
            wait_until(lambda: c.status()["steps"] == STEPS, 10, f"{server.name} at {STEPS} updates")
