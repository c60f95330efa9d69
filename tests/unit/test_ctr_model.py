"""Update rules against torch and brute force; the built-in DLRM is a model over Criteo's schema,
built alike by every process; the one-process baseline learns the generator's ground truth."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ps.spec.rules import Adagrad, RowWiseAdagrad, Sgd, rule
from rpcps.data.generated import SyntheticCtr, features
from rpcps.data.generated import GeneratedSource
from rpcps.quality import auc
from rpcps.schema import load_schema
from trainer.ctr import builtin
from trainer.ctr.config import CtrModelSettings
from trainer.ctr.local import LocalModel

REPO = Path(__file__).resolve().parents[2]


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


def test_the_builtin_model_is_the_dlrm_over_criteos_schema():
    settings = CtrModelSettings(scale=0.001, dim=8, bottom="16", top="16,8", tables="C3,C12", capacity_share=0.5,
                                table_dtype="fp16", pooling="mean")
    schema = builtin.criteo_schema(settings)
    assert schema.features == [f"C{t}" for t in range(1, 27)] and schema.numeric_names == [f"I{i}" for i in range(1, 14)]
    assert all(n.log1p and n.clip == (0, None) for n in schema.numeric)
    rows = {t.name: t for t in schema.tables}
    sizes = SyntheticCtr(scale=0.001).cardinalities
    assert rows["C3"].hashed and rows["C3"].rows == (sizes[2] + 1) // 2 and not rows["C4"].hashed
    assert rows["C4"].rows == sizes[3] and {t.dtype for t in schema.tables} == {"fp16"}
    assert {t.pooling for t in schema.tables} == {"mean"} and {t.dim for t in schema.tables} == {8}
    model, again = LocalModel.of(settings).module, LocalModel.of(settings).module
    assert [m.out_features for m in model.top if isinstance(m, torch.nn.Linear)] == [16, 8, 1]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters())), "every process builds it"
    other = LocalModel.of(settings.model_copy(update={"seed": 2})).module
    assert not torch.equal(model.bottom[0].weight, other.bottom[0].weight)


def test_the_criteo_example_is_the_builtin_model_and_schema():
    # What a user copies is what `--workload ctr` trains: the same file, and its schema at --scale 0.01,
    # but for each table's values counted into a vocabulary where the built-in takes them modulo.
    example = REPO / "examples" / "criteo_dlrm"
    assert (example / "model.py").read_text() == (REPO / "trainer" / "ctr" / "dlrm.py").read_text()
    own = builtin.criteo_schema(CtrModelSettings(scale=0.01))
    counted = tuple(t.model_copy(update={"vocabulary": True}) for t in own.tables)
    assert load_schema(example / "criteo.yaml") == own.model_copy(update={"tables": counted})


def test_generated_samples_become_the_schemas_features():
    data = SyntheticCtr(seed=2, scale=0.001)
    for hot in (1, 3):
        samples = data.batch(np.arange(5), hot)
        batch = features(samples)
        ids = samples.ids.reshape(5, 26, hot)
        for t in (0, 2, 25):
            f = batch.sparse[f"C{t + 1}"]
            assert f.offsets.tolist() == list(range(0, 5 * hot + 1, hot))
            assert f.values.tolist() == ids[:, t, :].reshape(-1).tolist()
        assert torch.equal(batch.dense, torch.from_numpy(samples.dense)) and batch.p is samples.p
        assert len(batch) == 5


def test_the_one_process_baseline_learns_the_ground_truth():
    data = SyntheticCtr(seed=2, scale=0.001)
    model = LocalModel.of(CtrModelSettings(scale=0.001, dim=8, bottom="32", top="32", optimizer="adagrad"))
    source = GeneratedSource(data, 512)
    test = features(data.batch(data.held_out(5000)))
    before = auc(model.predict(test), test.labels.numpy())
    for _ in range(80):
        model.step(source.next())
    after = auc(model.predict(test), test.labels.numpy())
    assert after > 0.62 and after > before + 0.05, (before, after, auc(test.p, test.labels.numpy()))
