"""The public model API in one process: jagged features, the tables module, what the servers'
model is derived as, and the sentences a wrong use gets."""
import pytest
import torch
import torch.nn as nn
from pydantic import ValidationError

import rpcps
from tests.support.bagged import TABLES, batch, build
from ps.server.participant import differences
from rpcps.tables import pool
from trainer.core.hosted import hosted_spec


def test_jagged_features_are_checked_and_sliced():
    f = rpcps.Jagged.of([[3, 4], [], [5]])
    assert f.batch_size == 3 and f.lengths.tolist() == [2, 0, 1]
    tail = f.rows(1, 3)
    assert tail.values.tolist() == [5] and tail.offsets.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="offsets go from 0"):
        rpcps.Jagged(torch.tensor([1, 2]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="int64"):
        rpcps.Jagged(torch.tensor([1.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="disagree on its size"):
        rpcps.Batch({"a": f}, torch.zeros(2, 1), torch.zeros(3))


def test_bags_pool_by_sum_and_mean_and_give_empty_bags_zeros():
    bags = rpcps.EmbeddingBags([rpcps.TableConfig(name="t", rows=10, dim=3, features=("a", "b"), pooling="mean"),
                                rpcps.TableConfig(name="s", rows=10, dim=3)])
    out = bags({"a": rpcps.Jagged.of([[1, 2], []]), "b": rpcps.Jagged.of([[2], [1]]), "s": rpcps.Jagged.of([[1, 1], [0]])})
    w, s = bags.weights["t"].detach(), bags.weights["s"].detach()
    assert torch.allclose(out["a"][0], (w[1] + w[2]) / 2) and torch.equal(out["a"][1], torch.zeros(3))
    assert torch.allclose(out["b"][1], w[1]), "features sharing a table read the same rows"
    assert torch.allclose(out["s"][0], 2 * s[1]), "a sum counts an id as often as it comes"
    assert float(w.abs().max()) <= 1 / 10 ** 0.5


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_served_rows_pool_as_the_tables_own_do(pooling):
    # A trainer pools the rows the servers sent for a feature's ids (``pool``) as the module pools
    # its own: a one-hot column's rows are its bags, a list column's are summed or averaged.
    table = torch.randn(10, 3)
    for ids in ([[1], [4], [1]], [[1, 2], [], [3]], [[5, 6], []]):
        f = rpcps.Jagged.of(ids)
        served = pool(table[f.values], f, pooling)
        own = torch.nn.functional.embedding_bag(f.values, table, f.offsets, mode=pooling, include_last_offset=True)
        assert torch.allclose(served, own), (ids, served, own)


def test_a_hashed_table_gives_raw_ids_rows_until_full():
    bags = rpcps.EmbeddingBags([rpcps.TableConfig(name="u", rows=2, dim=2, hashed=True)])
    first = bags({"u": rpcps.Jagged.of([[2 ** 60], [-7]])})
    assert torch.allclose(first["u"], bags.initial_rows("u", torch.tensor([2 ** 60, -7])))
    with pytest.raises(RuntimeError, match="hashed table u is full: 2 rows"):
        bags({"u": rpcps.Jagged.of([[5]])})


@pytest.mark.parametrize("tables,message", [
    ([rpcps.TableConfig(name="t", rows=2, dim=2)] * 2, "two tables are named t"),
    ([rpcps.TableConfig(name="t", rows=2, dim=2), rpcps.TableConfig(name="s", rows=2, dim=2, features=("t",))],
     "feature t is looked up in tables t and s"),
    ([], "one table at least"),
])
def test_a_wrong_declaration_is_a_sentence(tables, message):
    with pytest.raises(ValueError, match=message):
        rpcps.EmbeddingBags(tables)


def test_a_table_config_names_what_is_wrong():
    with pytest.raises(ValidationError, match="pooling"):
        rpcps.TableConfig(name="t", rows=2, dim=2, pooling="max")
    with pytest.raises(ValidationError, match="name"):
        rpcps.TableConfig(name="not a name", rows=2, dim=2)
    with pytest.raises(ValidationError, match="extra"):
        rpcps.TableConfig(name="t", rows=2, dim=2, size=3)


def test_a_batch_that_misses_a_feature_or_names_a_row_out_of_range_is_a_sentence():
    bags = rpcps.EmbeddingBags([rpcps.TableConfig(name="t", rows=4, dim=2)])
    with pytest.raises(KeyError, match="no feature t"):
        bags({"x": rpcps.Jagged.of([[1]])})
    with pytest.raises(ValueError, match="table t has rows 0 .. 3, but its features t name id 4"):
        bags({"t": rpcps.Jagged.of([[4]])})


def test_the_servers_model_is_derived_from_the_module():
    model = build()
    spec = hosted_spec(model, optimizer="adagrad", lr=0.1)
    assert set(spec.tables) == {t.name for t in TABLES}
    assert spec.tables["item"].params == {"tables.weights.item": (4,)}
    assert spec.tables["user"].hashed is not None and spec.tables["genre"].rule == "sgd"
    assert [sorted(g.params) for g in spec.dense] == [["bottom.bias", "bottom.weight"],
                                                      ["top.0.bias", "top.0.weight", "top.2.bias", "top.2.weight"]]
    initial = spec.dense[0].init()
    assert torch.equal(initial["bottom.weight"], model.bottom.weight), "the servers start from the module's weights"
    rows = spec.tables["item"].init(torch.tensor([3, 39]))["tables.weights.item"]
    assert torch.equal(rows, build().tables.materialize().weights["item"].detach()[[3, 39]])
    assert not list(model.tables.parameters()), "deriving the servers' model builds no table here"
    with pytest.raises(Exception, match="holds no rpcps.EmbeddingBags"):
        hosted_spec(nn.Linear(2, 2))


def test_a_checkpoint_restores_into_the_same_tables_stored_placed_or_bounded_otherwise():
    def restorable(**change) -> dict:
        tables = [t.model_copy(update=change.get(t.name, {})) for t in TABLES]

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tables = rpcps.EmbeddingBags(tables)
                self.top = nn.Linear(4, 1)
        spec = hosted_spec(Model(), optimizer="adagrad", table_rule=change.get("rule"))
        return {k: spec.meta[k] for k in spec.compatible}

    same = restorable()
    assert restorable(user={"rows": 32}, item={"dtype": "fp16", "wire_dtype": "bf16", "placement": "table_wise"},
                      genre={"pooling": "mean"}) == same, "capacity, precision, placement, pooling may change"
    for change in ({"item": {"rows": 41}}, {"item": {"dim": 8}}, {"genre": {"rule": "adagrad"}},
                   {"user": {"hashed": False}}):
        assert restorable(**change) != same, change
    # A refused checkpoint says what differs, not the whole model.
    said = differences("restorable", same["restorable"], restorable(item={"rows": 41})["restorable"])
    assert said == "restorable.tables.tables.weights.item.rows=40, this server has 41"
    assert differences("restorable", None, same["restorable"]).startswith("no restorable recorded")


def test_one_process_training_steps_each_table_by_its_rule():
    model = build()
    optimizer = rpcps.local_optimizer(model, "adagrad", 0.1)
    b = batch(1, 16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(b), b.labels)
    optimizer.zero_grad()
    loss.backward()
    assert model.tables.weights["item"].grad.is_sparse, "table gradients touch only the rows used"
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert {"tables.weights.item", "tables.weights.genre", "tables.weights.user", "top.2.weight"} <= moved
    assert {n: type(r).__name__ for p, r in optimizer.params for n, q in model.named_parameters() if q is p
            and n.startswith("tables.")} == {"tables.weights.item": "RowWiseAdagrad", "tables.weights.genre": "Sgd",
                                             "tables.weights.user": "Adagrad"}
