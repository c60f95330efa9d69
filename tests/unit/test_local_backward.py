"""A step whose backward runs on the trainer: its leaves' gradients read as a context's are, and
gathered one message a server, a row named twice sent once with its gradients summed."""
import pytest
import torch

from ps.client.fetching import GradOf, merged
from trainer.ctr.config import CtrUpSettings


def test_a_leaf_gradient_is_read_as_a_context_gives_it():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    (3 * a).sum().backward()
    grads = GradOf()
    assert a in grads and b not in grads
    assert torch.equal(grads[a], torch.full((2,), 3.0)) and grads.get(b) is None


def test_pushes_are_gathered_per_server_each_row_once():
    rows = lambda ids, value: (torch.tensor(ids), torch.full((len(ids), 2), value))  # noqa: E731
    w = torch.ones(3)
    out = merged([(0, {"t": rows([4, 1], 1.0)}, {}), (1, {"t": rows([7], 2.0)}, {}),
                  (0, {"t": rows([1, 9], 10.0), "u": rows([2], 5.0)}, {"w": w})])
    assert sorted(out) == [0, 1]
    ids, grad = out[0][0]["t"]
    got = dict(zip(ids.tolist(), grad[:, 0].tolist()))
    assert got == {1: 11.0, 4: 1.0, 9: 10.0}, "id 1 came in two answers: once, its gradients summed"
    assert out[0][0]["u"][0].tolist() == [2] and out[0][1]["w"] is w
    assert out[1][0]["t"][0].tolist() == [7] and out[1][1] == {}


def test_local_backward_with_a_hashed_table_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--backward local with --tables C3: a hashed table's reads"):
        CtrUpSettings.model_validate({"tables": "C3", "backward": "local"})
    assert CtrUpSettings.model_validate({"tables": "C3"}).backward is None
    assert CtrUpSettings.model_validate({"backward": "local"}).backward == "local"
