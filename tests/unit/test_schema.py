"""Feature schemas: every way a schema file can be wrong is a sentence naming the file and key,
and every way a line can be wrong is skipped and counted with its file, line and column, as
Criteo lines are; what a line becomes is what the schema says."""
import pytest
import torch

import rpcps
from rpcps.data.lines import LineError
from rpcps.data.encoding import Encoder, value_id
from rpcps.data.statistics import check, measure, rows_of
from rpcps.data.text import SchemaStream
from tests.support.cluster import REPO

SCHEMA = """\
label: y
numeric:
  - {column: price, fill: 1, clip: [0, 100], log1p: true}
  - {column: age, standardize: true, mean: 30, std: 10}
categorical:
  - {column: item, table: item}
  - {column: seen, table: item, separator: "|", max_length: 2}
  - {column: user, table: user}
tables:
  - {name: item, rows: 50, dim: 4, pooling: mean}
  - {name: user, rows: 100, dim: 4, hashed: true}
"""


def schema_file(tmp_path, text=SCHEMA, name="s.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("change,message", [
    (("label: y\n", "label: y\nsize: 3\n"), "s.yaml: size: Extra inputs are not permitted"),
    (("label: y\n", ""), "s.yaml: label: Field required"),
    (("{column: user, table: user}", "{column: item, table: user}"), "feature item is declared twice"),
    (("{column: user, table: user}", "{column: user, table: users}"),
     "feature user uses table users, which `tables` does not declare (it declares item, user)"),
    (("log1p: true", "log1p: yes please"), "numeric[0].log1p: Input should be a valid boolean"),
    (("clip: [0, 100]", "clip: [100, 0]"), "numeric[0]: clip needs [low, high]"),
    (("mean: 30, std: 10", "mean: 30"), "give both mean and std, or neither"),
    (("pooling: mean", "pooling: max"), "tables[0].pooling: Input should be 'sum' or 'mean'"),
    (("  - {name: user, rows: 100, dim: 4, hashed: true}\n", "  - {name: user, rows: 100, dim: 4}\n"
      "  - {name: spare, rows: 2, dim: 4}\n"), "no categorical column uses table spare"),
    (("label: y\n", "label: y\nheader: false\ncolumns: [y, price, age, item, seen]\n"),
     "columns: user named but not among the columns"),
    (("separator: \"|\", max_length: 2", "max_length: 2"), "max_length is for a list of values"),
])
def test_every_wrong_schema_is_a_sentence_naming_the_file_and_key(tmp_path, change, message):
    text = SCHEMA.replace(*change)
    assert text != SCHEMA
    with pytest.raises(rpcps.SchemaError) as caught:
        rpcps.load_schema(schema_file(tmp_path, text))
    assert str(caught.value).startswith(f"{tmp_path / 's.yaml'}: ") and message in str(caught.value), caught.value


def test_a_schema_is_yaml_or_toml_and_a_broken_file_says_where(tmp_path):
    toml = rpcps.load_schema(schema_file(tmp_path, 'label = "y"\n[[categorical]]\ncolumn = "item"\n'
                                                   '[[tables]]\nname = "item"\nrows = 5\ndim = 2\n', "s.toml"))
    assert toml.features == ["item"] and toml.table_configs()[0].features == ("item",)
    with pytest.raises(rpcps.SchemaError, match=r"s.yaml: not valid YAML: .*line 2"):
        rpcps.load_schema(schema_file(tmp_path, "label: y\n  : [\n"))
    with pytest.raises(rpcps.SchemaError, match="a .yaml, .yml or .toml file"):
        rpcps.load_schema(schema_file(tmp_path, "{}", "s.json"))
    with pytest.raises(rpcps.SchemaError, match="cannot be read"):
        rpcps.load_schema(tmp_path / "missing.yaml")


def test_the_tests_ratings_schema_loads():
    schema = rpcps.load_schema(REPO / "tests" / "support" / "ratings_schema.yaml")
    assert schema.features == ["user_id", "movie_id", "genres", "occupation"]
    assert schema.numeric_names == ["age", "year"]


def write(tmp_path, *lines, header="y,price,age,item,seen,user"):
    path = tmp_path / "d.csv"
    path.write_text("\n".join([header, *lines]) + "\n")
    return [path]


def test_lines_become_a_batch_as_the_schema_says(tmp_path):
    schema = rpcps.load_schema(schema_file(tmp_path))
    paths = write(tmp_path, '1,,40,a,"a|b|c",u1', "0,-5,20,b,,u1", "1,1e9,30,,b,u2")
    batch = next(SchemaStream(Encoder(schema), paths).batches(8))
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    # price: empty -> fill 1, -5 -> clip 0, 1e9 -> clip 100; then log1p. age: (x - 30) / 10.
    expected = torch.tensor([[1.0, 1.0], [0.0, -1.0], [100.0, 0.0]])
    expected[:, 0] = torch.log1p(expected[:, 0])
    assert torch.allclose(batch.dense, expected)
    a, b = value_id("item", "a") % 50, value_id("item", "b") % 50
    assert batch.sparse["item"].values.tolist() == [a, b] and batch.sparse["item"].lengths.tolist() == [1, 1, 0]
    # A list past its max_length is cut (and counted); both item features share the table's ids.
    assert batch.sparse["seen"].values.tolist() == [a, b, b] and batch.sparse["seen"].lengths.tolist() == [2, 0, 1]
    users = batch.sparse["user"].values.tolist()
    assert users[0] == users[1] == value_id("user", "u1") and users[0] != users[2], "hashed: raw 64-bit ids"
    assert any(u < 0 or u >= 100 for u in users), "a hashed table takes the raw id, not one modulo its rows"


def test_every_wrong_line_is_skipped_and_counted_with_its_file_line_and_column(tmp_path):
    schema = rpcps.load_schema(schema_file(tmp_path))
    paths = write(tmp_path, "1,2,30,a,b,u", "x,2,30,a,b,u", "2,2,30,a,b,u", "1,abc,30,a,b,u", "1,2,inf,a,b,u",
                  "1,2,30,a,b", '1,2,30,"a,b",b,u', "1,2,30,a,b,u", "1,2,1e308,a,b,u", "1,-3.5e38,30,a,b,u",
                  "1,3.4e38,-3.4e38,a,b,u")
    stream = rows_of(schema, paths, logged=False)
    assert len(list(stream)) == 4 and stream.skipped == 7, stream.reasons
    where = str(paths[0])
    assert stream.reasons == [f"{where}:3: the label y must be a number in [0, 1], got 'x'",
                              f"{where}:4: the label y must be a number in [0, 1], got '2'",
                              f"{where}:5: column price is not a number: 'abc'",
                              f"{where}:6: column age is not a finite number: 'inf'",
                              f"{where}:7: expected 6 CSV fields, found 5",
                              f"{where}:10: column age is '1e308', beyond float32's range (±3.403e+38), which the model "
                              f"computes in",
                              f"{where}:11: column price is '-3.5e38', beyond float32's range (±3.403e+38), which the "
                              f"model computes in"]


def test_a_header_without_a_column_refuses_the_files_before_anything_starts(tmp_path):
    schema = rpcps.load_schema(schema_file(tmp_path))
    paths = write(tmp_path, "1,2,30,a,b", header="y,price,age,item,seen")
    with pytest.raises(LineError, match=r"d.csv:1: the header has no column user \(it has 'y, price, age, item, seen'\)"):
        check(schema, paths, 10)
    stream = rows_of(schema, paths, logged=False)
    assert list(stream) == [] and "the whole file is skipped" in stream.reasons[0]


def test_measured_statistics_are_the_same_for_every_trainer(tmp_path):
    schema = rpcps.load_schema(schema_file(tmp_path, SCHEMA.replace(", mean: 30, std: 10", "")))
    paths = write(tmp_path, *[f"1,2,{age},a,b,u" for age in (10, 20, 30, 40)])
    assert measure(schema, paths) == {"age": (25.0, pytest.approx(5 * 5 ** 0.5))}
    with pytest.raises(ValueError, match="standardized column age has no mean and std"):
        Encoder(schema)


def test_one_entry_may_say_the_same_of_several_columns(tmp_path):
    schema = rpcps.load_schema(schema_file(tmp_path, """\
label: y
numeric: [{column: [a, b], clip: [0, null], log1p: true}, {column: c}]
categorical: [{column: [x, z]}, {column: w, table: x}]
tables: [{name: x, rows: 5, dim: 2}, {name: z, rows: 5, dim: 2}]
"""))
    assert schema.numeric_names == ["a", "b", "c"] and schema.numeric[1].clip == (0.0, None)
    assert [(c.name, c.table_name) for c in schema.categorical] == [("x", "x"), ("z", "z"), ("w", "x")]
    paths = write(tmp_path, "1,-3,4,5,p,q,r", header="y,a,b,c,x,z,w")
    batch = next(SchemaStream(Encoder(schema), paths).batches(4))
    assert torch.allclose(batch.dense, torch.tensor([[0.0, float(torch.log1p(torch.tensor(4.0))), 5.0]]))


def test_a_value_log1p_cannot_take_is_a_malformed_line(tmp_path):
    schema = rpcps.load_schema(schema_file(tmp_path, SCHEMA.replace("clip: [0, 100], ", "")))
    stream = rows_of(schema, write(tmp_path, "1,-1,30,a,b,u", "1,-0.5,30,a,b,u"), logged=False)
    assert [r.numeric[0] for r in stream] == [-0.5]
    assert stream.reasons == [f"{tmp_path / 'd.csv'}:2: column price takes log1p, which needs a value above -1, got -1"]
