"""Several trainers stepping the same parameters at once lose no update and share one optimizer state.

The drivers' gradients do not depend on the parameters, so the end state is exactly the initial one
with every update applied once, in any order; replaying them in one process gives it bit for bit.
"""
import pytest
import torch

from tests.support.cluster import SMALL_MODEL
from tests.support.driver import hammer_batch, local_parameters
from trainer.lm.config import LmModelConfig as ModelConfig
from trainer.lm.model import LocalLM

TRAINERS, STEPS = 3, 30


def replay(model: ModelConfig, updates: int) -> dict[str, torch.Tensor]:
    local = LocalLM(model, dropout=0.0)
    ids, targets = hammer_batch(model.ntoken)
    unique, counts = torch.unique(ids, return_counts=True)
    tcount = torch.bincount(targets, minlength=model.ntoken).float()
    emb_grad = torch.sparse_coo_tensor(unique.unsqueeze(0), counts.float().unsqueeze(1).expand(-1, model.emsize),
                                       (model.ntoken, model.emsize), check_invariants=True)
    for _ in range(updates):
        local.embedding.weight.grad = emb_grad.clone()
        local.decoder.weight.grad = tcount.unsqueeze(1).expand(-1, model.nhid).clone()
        local.decoder.bias.grad = tcount.clone()
        for p in local.body.lstm.parameters():
            p.grad = torch.ones_like(p)
        local.optimizer.step()
    return local_parameters(local)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_concurrent_trainers_lose_no_update(procs, tmp_path, optimizer):
    model = {**SMALL_MODEL, "lr": 0.125, "optimizer": optimizer}
    servers = procs.start_servers(2, **model)
    drivers = [procs.spawn_driver("hammer", f"trainer{i}", 2, steps=STEPS) for i in range(TRAINERS)]
    for d in drivers:
        out, err = d.communicate(timeout=180)
        assert d.returncode == 0, err[-3000:]
    procs.run_driver("inspect", "trainer9", 2, out=tmp_path / "params.pt")
    got = torch.load(tmp_path / "params.pt", weights_only=True)

    expected = replay(ModelConfig(**model), TRAINERS * STEPS)
    lost = {k: int((got[k] != expected[k]).sum()) for k in expected}
    assert sum(lost.values()) == 0, f"elements differing from every-update-applied: {lost}"
    # ...and the run really moved them: applying one update fewer would differ.
    short = replay(ModelConfig(**model), TRAINERS * STEPS - 1)
    assert any(not torch.equal(got[k], short[k]) for k in expected)
    # Every async update's staleness was measured, on every server, from the step's first read.
    for server in servers:
        with server.client() as c:
            counts = [line for line in c.metrics().splitlines()
                      if line.startswith("rpcps_ps_update_staleness_steps_count")]
        assert counts and float(counts[0].split()[-1]) == TRAINERS * STEPS, (server.name, counts)
