"""One trainer sending gradients that are not finite, in every consistency mode: the servers refuse
each such update whole, count it, and the shared model ends exactly as if that trainer's steps had
never been sent (the hammer steps' gradients do not depend on the parameters, so that state is
known to the bit). The same for a hashed table of the CTR model: a refused step leaves every row
as it was. A trainer's old incarnation, evicted and replaced, is refused by every server."""

import json
import os
import signal

import pytest
import torch

from tests.integration.test_concurrent_updates import replay
from tests.support.cluster import SMALL_MODEL
from tests.support.wait import wait_until
from trainer.lm.config import LmModelConfig as ModelConfig

HONEST_STEPS, POISONED_STEPS = 6, 4


@pytest.mark.parametrize("mode", ["async", "sync", "ssp:1"])
def test_non_finite_updates_are_refused_whole_and_the_model_stays_as_without_them(procs, tmp_path, mode):
    model = {**SMALL_MODEL, "lr": 0.125, "optimizer": "sgd"}
    servers = procs.start_servers(2, consistency=mode, **model)
    runs = dict(zip(("honest", "poisoned"), procs.finish_drivers([
        procs.spawn_driver("hammer", "trainer0", 2, steps=HONEST_STEPS),
        procs.spawn_driver("hammer", "trainer1", 2, steps=POISONED_STEPS, poison="nan,inf")])))
    assert runs["honest"]["refused"] == []
    assert len(runs["poisoned"]["refused"]) == POISONED_STEPS, runs["poisoned"]
    assert all("not finite" in r for r in runs["poisoned"]["refused"]), runs["poisoned"]["refused"]

    procs.run_driver("inspect", "trainer9", 2, out=tmp_path / "params.pt")
    got = torch.load(tmp_path / "params.pt", weights_only=True)
    expected = replay(ModelConfig(**model), HONEST_STEPS)
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    differing = {k: int((got[k] != expected[k]).sum()) for k in expected}
    assert sum(differing.values()) == 0, f"elements differing from the honest trainer's steps alone: {differing}"

    refused = 0
    for server in servers:
        with server.client() as c:
            line = [x for x in c.metrics().splitlines() if x.startswith("rpcps_ps_updates_refused_total")]
            refused += int(float(line[0].split()[-1]))
            assert c.status()["refused"] == int(float(line[0].split()[-1]))
    assert refused >= POISONED_STEPS, "every poisoned step was refused by at least one server"
    # The model is sound, so a checkpoint of it is taken.
    with servers[0].client() as c:
        assert c.checkpoint()["step"] == HONEST_STEPS


def test_non_finite_updates_to_a_hashed_table_are_refused_whole(procs):
    # The CTR model with its table C3 keyed by raw 64-bit ids, on two servers (async mode).
    procs.start_servers(2, workload="ctr", scale=0.0005, dim=4, bottom="8", top="8", tables="C3")
    result = procs.run_driver("poison_hashed", "ctr0", 2)
    assert result["refused"][0] is None and result["refused"][3] is None, result
    assert all(r and "not finite" in r for r in result["refused"][1:3]), result
    assert result["refused_left_all"] and result["honest_moved"], result


def test_an_old_incarnation_is_refused_by_every_server_and_counted(procs, tmp_path):
    # No supervisor here: trainer0 frozen past the leader's probes is evicted, and another
    # trainer0 joins under a newer rank. The old one, continued, tries a step: refused whole.
    servers = procs.start_servers(2, **SMALL_MODEL)
    go = tmp_path / "go"
    old = procs.spawn_driver("stale", "trainer0", 2, out=go)
    old_rank = json.loads(old.stdout.readline())["rank"]
    os.kill(old.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: "trainer0" not in servers[0].client(timeout=2.0).status()["members"], 30,
                   "ps0 to evict the frozen trainer0")
        new = procs.spawn_driver("stale", "trainer0", 2, out=tmp_path / "never")
        new_rank = json.loads(new.stdout.readline())["rank"]
    finally:
        os.kill(old.pid, signal.SIGCONT)
    go.touch()
    out, err = old.communicate(timeout=60)
    refused = json.loads(out.strip().splitlines()[-1])["refused"]
    assert new_rank > old_rank and refused and f"from trainer0 of rank {old_rank} refused" in refused, (refused, err)
    # A server's /status is refreshed each second, its metrics at once: wait for the refusal to
    # show in both, the same count.
    def superseded(server) -> tuple[int, int]:
        metric = [x for x in server.client(timeout=2.0).metrics().splitlines()
                  if x.startswith("rpcps_ps_requests_superseded_total")]
        return server.client(timeout=2.0).status()["superseded"], int(float(metric[0].split()[-1]))
    wait_until(lambda: (c := [superseded(s) for s in servers]) and sum(shown for shown, _ in c) >= 1
               and all(shown == metric for shown, metric in c), 10, "the refusal counted in /status and the metrics")
