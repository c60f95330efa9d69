"""Update rules against torch and brute force; the DLRM's initial values as pure functions; the
one-process baseline learns the generator's ground truth."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.spec.rules import Adagrad, RowWiseAdagrad, Sgd, rule
from trainer.ctr.config import CtrModelConfig
from trainer.ctr.model import DlrmDense, LocalDlrm, interactions, table_rows
from trainer.ctr.quality import auc
from trainer.ctr.synthetic import SyntheticCtr


def sparse_steps(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        ids = torch.tensor([1, 3, 3, 7, 0])                  # a repeated row: its gradients add up
        yield torch.sparse_coo_tensor(ids[None], torch.randn(5, 4, generator=gen), (10, 4))


@pytest.mark.parametrize("mine, theirs", [(Sgd(), lambda p: torch.optim.SGD([p], lr=0.1)),
                                          (Adagrad(), lambda p: torch.optim.Adagrad([p], lr=0.1))])
@pytest.mark.parametrize("sparse", [True, False])
def test_sgd_and_adagrad_are_torchs_to_the_bit(mine, theirs, sparse):
    start = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    p, w = torch.nn.Parameter(start.clone()), start.clone()
    opt, state = theirs(p), {k: torch.zeros(s) for k, s in mine.state_shapes(w).items()}
    for g in sparse_steps():
        g = g if sparse else g.to_dense()
        p.grad = g.clone()
        opt.step()
        mine.step(w, g.clone(), state, 0.1)
    assert torch.equal(p.detach(), w)


def test_rowwise_adagrad_keeps_one_value_a_row():
    start = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    w, dense_w = start.clone(), start.clone()
    r = RowWiseAdagrad()
    state, dense_state = {"sum": torch.zeros(10)}, {"sum": torch.zeros(10)}
    expect, total = start.clone().double(), torch.zeros(10, dtype=torch.float64)
    for g in sparse_steps():
        r.step(w, g, state, 0.1)
        r.step(dense_w, g.to_dense(), dense_state, 0.1)
        rows = g.coalesce()
        for i, v in zip(rows.indices()[0].tolist(), rows.values().double()):
            total[i] += v.pow(2).mean()
            expect[i] -= 0.1 * v / (total[i].sqrt() + 1e-10)
    assert state["sum"].shape == (10,)
    assert torch.allclose(w.double(), expect, atol=1e-6) and torch.allclose(state["sum"].double(), total)
    untouched = [i for i in range(10) if i not in (0, 1, 3, 7)]
    assert torch.equal(w[untouched], start[untouched])
    # A dense gradient with zero rows steps them by zero but counts nothing for them either.
    assert torch.allclose(dense_w, w, atol=1e-6)
    with pytest.raises(ValueError, match="unknown update rule 'adam': one of sgd, adagrad, rowwise_adagrad"):
        rule("adam")


def test_initial_rows_are_functions_of_seed_table_and_row():
    cfg = CtrModelConfig(cardinalities=(1000, 50), dim=8, seed=3)
    whole = table_rows(cfg, 0, torch.arange(1000))
    assert torch.equal(table_rows(cfg, 0, torch.tensor([7, 500, 999])), whole[[7, 500, 999]])
    assert not torch.equal(table_rows(cfg, 1, torch.arange(50)), whole[:50])
    assert whole.abs().max() <= 1 / 1000 ** 0.5 and whole.std() > 0.3 / 1000 ** 0.5
    assert torch.equal(DlrmDense(cfg).top[0].weight, DlrmDense(cfg).top[0].weight)   # no shared generator


def test_the_one_process_baseline_learns_the_ground_truth():
    torch.manual_seed(0)
    data = SyntheticCtr(seed=2, scale=0.001)
    cfg = CtrModelConfig(cardinalities=data.cardinalities, dim=8, bottom=(32,), top=(32,), optimizer="adagrad")
    assert DlrmDense(cfg)(torch.zeros(4, 13), torch.zeros(4, 26, 8)).shape == (4,) and interactions(cfg) == 351
    model = LocalDlrm(cfg, lr=0.1)
    test = data.batch(data.held_out(5000))
    before = auc(model.predict(test), test.labels)
    for step in range(80):
        model.step(data.batch(np.arange(step * 512, (step + 1) * 512)))
    after = auc(model.predict(test), test.labels)
    assert after > 0.62 and after > before + 0.05, (before, after, auc(test.p, test.labels))
