"""What `rpcps up --workload ctr` tries before any member starts, without a cluster: a user's model
that cannot be imported, built or run forward is one sentence; a held-out set that leaves nothing
to train on is refused and one that takes most of the data warned of; values sharing a plain
table's rows are counted and warned of; `--model` alone chooses the CTR workload."""
import random

import pytest
import torch

from rpcps.data.lines import LineError
from rpcps.data.statistics import check, named, occupancy, rows_of
from rpcps.schema import load_schema
from rpcps.tables import TableConfig as rpcps_table
from services.config import load
from services.errors import ConfigError
from supervise.upconfig import UpConfig
from tests.support.cluster import REPO
from trainer.ctr.config import CtrUpSettings
from trainer.ctr.preflight import preflight

SCHEMA = REPO / "tests" / "support" / "ratings_schema.yaml"
GOOD = "tests.support.ratings_model:RatingsModel"
GENRES = ["Action", "Comedy", "Drama", "War", "Horror", "Crime", "Western", "Musical", "Mystery", "Romance", "Sci-Fi",
          "Thriller", "Film-Noir", "Fantasy", "Documentary", "Children", "Animation", "Adventure"]


def ratings(path, lines: int, header: bool = True, seed: int = 5):
    rng = random.Random(seed)
    path.mkdir(exist_ok=True)
    rows = ["label,user_id,movie_id,genres,occupation,age,year"] if header else []
    for _ in range(lines):
        rows.append(f"{rng.randrange(2)},{rng.randrange(300)},{rng.randrange(5)},"
                    f"{'|'.join(rng.sample(GENRES, 2))},{rng.randrange(21)},{rng.randrange(18, 60)},"
                    f"{rng.randrange(1950, 2000)}")
    (path / "part_0.csv").write_text("\n".join(rows) + "\n")
    return path


def settings(data, model=GOOD, **more) -> CtrUpSettings:
    return CtrUpSettings(user_model=model, schema_file=SCHEMA, data=data, **more)


def test_a_good_model_passes_and_plain_tables_whose_values_share_rows_are_warned_of(tmp_path):
    warnings = preflight(settings(ratings(tmp_path / "d", 600), eval_samples=100))
    shared = sorted(w.split(":")[0] for w in warnings)
    # genre: 18 values over 18 rows, occupation: 21 over 21 (plain tables); user is hashed, and
    # 5 movies over 500 rows share none.
    assert shared == ["table genre", "table occupation"], warnings
    genre = next(o for o in occupancy(load_schema(SCHEMA), list(rows_of(load_schema(SCHEMA),
                                                                        [tmp_path / "d" / "part_0.csv"])))
                 if o.table == "genre")
    assert genre.distinct == 18 and genre.rows_used < 18 and genre.sharing > 0
    assert f"{genre.sharing} of the 18 distinct values" in next(w for w in warnings if w.startswith("table genre"))


@pytest.mark.parametrize("source,said", [
    ("class M(:\n", "importing {mod} failed: SyntaxError: invalid syntax"),
    ("raise RuntimeError('no GPU here')\n", "importing {mod} failed: RuntimeError: no GPU here"),
    ("import not_a_module_anywhere\n", "no module not_a_module_anywhere (is it installed"),
    ("class Other: pass\n", "{mod} has no M"),
    ("import torch.nn as nn\nclass M(nn.Module):\n    def __init__(self, schema):\n        raise KeyError('x')\n",
     "M(schema) raised KeyError: 'x'"),
    ("import torch.nn as nn\nclass M(nn.Module):\n    def __init__(self, schema):\n        super().__init__()\n"
     "    def forward(self, batch):\n        return batch.dense @ 3\n",
     "M: its forward over 64 samples of --data raised TypeError: unsupported operand"),
    ("import torch, torch.nn as nn\nclass M(nn.Module):\n    def __init__(self, schema):\n        super().__init__()\n"
     "    def forward(self, batch):\n        return torch.zeros(len(batch), 1)\n",
     "its forward over 64 samples gave a tensor of shape [64, 1] (torch.float32); it must give a logit a sample, "
     "a float tensor of shape [64]"),
    ("import torch.nn as nn\nclass M(nn.Module):\n    def __init__(self, schema):\n        super().__init__()\n"
     "    def forward(self, batch):\n        return [0.0]\n",
     "its forward over 64 samples gave a list"),
])
def test_a_mistake_in_the_model_file_is_one_sentence(tmp_path, monkeypatch, source, said):
    mod = f"usermodel_{abs(hash(source))}"
    (tmp_path / f"{mod}.py").write_text(source)
    monkeypatch.chdir(tmp_path)        # found in the working folder, as `rpcps up` finds it
    monkeypatch.delitem(__import__("sys").modules, mod, raising=False)
    data = ratings(tmp_path / "d", 100)
    with pytest.raises(ConfigError) as refused:
        preflight(settings(data, f"{mod}:M", eval_samples=10))
    assert str(refused.value).startswith(f"--model {mod}:M: ") and said.format(mod=mod) in str(refused.value), \
        str(refused.value)


def test_a_held_out_set_of_every_line_is_refused_and_one_of_most_lines_warned_of(tmp_path):
    data = ratings(tmp_path / "d", 300)
    with pytest.raises(ConfigError, match="--eval-samples 300 holds out every one of the 300 records"):
        preflight(settings(data, eval_samples=300))
    held = [w for w in preflight(settings(data, eval_samples=200)) if w.startswith("--eval-samples")]
    assert held == ["--eval-samples 200 holds out 67% of the 300 records of --data and trains on the other 100 "
                    "(set it lower to train on more)"]
    assert not [w for w in preflight(settings(data, eval_samples=100)) if w.startswith("--eval-samples")]
    assert not [w for w in preflight(settings(data, eval_samples=0)) if w.startswith("--eval-samples")]


def test_fewer_records_to_train_on_than_trainers_are_refused_before_anything_starts(tmp_path):
    data = ratings(tmp_path / "d", 12)
    with pytest.raises(ConfigError) as refused:
        preflight(settings(data, eval_samples=10, num_trainers=3))
    assert str(refused.value) == ("--data has 2 records to train on after the 10 held out, fewer than the 3 trainers: "
                                  "trainer k of 3 trains on records k, k + 3, …, so 1 would have none (use "
                                  "--trainers 2 or fewer, or more data)")
    assert not [w for w in preflight(settings(data, eval_samples=9, num_trainers=3)) if "trainers" in w]
    with pytest.raises(ConfigError, match="--data has 12 records to train on, fewer than the 13 trainers"):
        preflight(settings(data, eval_samples=0, num_trainers=13))
    # A followed folder's trainers wait for the next file instead.
    assert preflight(settings(data, eval_samples=0, num_trainers=13, follow=True)) is not None


def test_files_of_a_header_and_no_line_are_refused_before_anything_starts(tmp_path):
    data = ratings(tmp_path / "d", 0)
    with pytest.raises(LineError, match="part_0.csv: no data lines, only a header"):
        check(load_schema(SCHEMA), [data / "part_0.csv"], 1000)
    check(load_schema(SCHEMA), [data / "part_0.csv"], 1)     # a look at the header alone says nothing of lines
    with pytest.raises(ConfigError, match="no data lines, only a header"):
        load(UpConfig, {"model": GOOD, "schema": str(SCHEMA), "data": str(data)}, {})


def test_model_alone_chooses_the_ctr_workload_and_nothing_changes_the_default():
    data = REPO / "examples"        # not read: --schema without the CTR settings is what is asked here
    assert load(UpConfig, {}, {}).workload == "lm"
    assert load(UpConfig, {"steps": 5}, {}).workload == "lm"
    assert load(UpConfig, {"scale": 0.01}, {}).workload == "ctr"
    with pytest.raises(ConfigError, match="--model builds your model from a feature schema: give --schema too"):
        load(UpConfig, {"model": GOOD, "steps": 5}, {})
    with pytest.raises(ConfigError, match="not a setting of --workload lm"):
        load(UpConfig, {"workload": "lm", "model": GOOD, "data": str(data)}, {})


def test_standardized_columns_are_measured_once_on_training_lines_and_recorded_for_every_member(tmp_path):
    from trainer.ctr.preflight import recorded_schema
    data = ratings(tmp_path / "d", 400)
    lines = (data / "part_0.csv").read_text().splitlines()
    # The first 100 lines (held out) are 90 years old; the training lines keep their ages (18-59).
    lines[1:101] = [",".join(line.split(",")[:5] + ["90", line.split(",")[6]]) for line in lines[1:101]]
    (data / "part_0.csv").write_text("\n".join(lines) + "\n")
    path = recorded_schema(settings(data, eval_samples=100), tmp_path / "state")
    written = load_schema(path)
    age = next(n for n in written.numeric if n.column == "age")
    assert 18 <= age.mean < 60 and age.std > 0, age
    assert next(n for n in written.numeric if n.column == "year").mean == 1985, "given statistics stay"
    assert written.tables == load_schema(SCHEMA).tables and written.categorical == load_schema(SCHEMA).categorical
    assert recorded_schema(settings(data, eval_samples=100).model_copy(update={"schema_file": path}),
                           tmp_path / "again") is None, "nothing left to measure"


def test_held_out_files_of_their_own_are_evaluated_and_every_data_line_trained_on(tmp_path):
    from rpcps.data.builders import schema_source
    data, held = ratings(tmp_path / "d", 300), ratings(tmp_path / "e", 50, seed=6)
    schema = load_schema(SCHEMA)
    apart = schema_source(schema, data, 100, held=40, eval_data=held)
    together = schema_source(schema, data, 100, held=40)
    evaluated = [len(b) for b in apart.held_out(40, 16)]
    assert sum(evaluated) == 40 and sum(len(b) for b in together.held_out(40, 16)) == 40
    labels = [float(line.split(",")[0]) for line in (held / "part_0.csv").read_text().splitlines()[1:41]]
    assert [x for b in apart.held_out(40, 16) for x in b.labels.tolist()] == labels, "--eval-data's first lines"
    assert [x for b in together.held_out(40, 16) for x in b.labels.tolist()] != labels
    assert apart.next() is not None and apart.cursor == 100 and together.next() is not None and together.cursor == 140
    assert "held out: " in apart.description and "the first 40 records held out" in together.description
    # No line of --data is held out, so none is refused or warned of for it.
    assert not [w for w in preflight(settings(data, eval_samples=300, eval_data=held))
                if w.startswith("--eval-samples")]
    # A held-out file larger than --eval-samples: the run says what it evaluates.
    assert [w for w in preflight(settings(data, eval_samples=30, eval_data=held)) if w.startswith("--eval-data")] == \
        [f"--eval-data {held} holds more than 30 records: the evaluation takes its first 30 (--eval-samples; give a "
         f"larger one to evaluate more of it)"]
    with pytest.raises(ConfigError, match="--eval-data holds lines out of data files: give --data too"):
        load(UpConfig, {"workload": "ctr", "eval_data": str(held)}, {})


def vocabulary_schema(tmp_path, min_count=1, genre_rows=32):
    text = SCHEMA.read_text().replace("{name: genre, rows: 18, dim: 8, pooling: mean, rule: sgd}",
                                      f"{{name: genre, rows: {genre_rows}, dim: 8, pooling: mean, rule: sgd, "
                                      f"vocabulary: true, min_count: {min_count}}}")
    (tmp_path / "vocabulary.yaml").write_text(text.replace("{name: occupation, rows: 21, dim: 8}",
                                                           "{name: occupation, rows: 8, dim: 8, vocabulary: true}"))
    return tmp_path / "vocabulary.yaml"


def test_a_vocabulary_gives_each_value_named_enough_a_row_of_its_own_and_the_rest_row_0(tmp_path):
    from rpcps.data.encoding import Encoder
    from rpcps.data.statistics import named, vocabularies
    schema = load_schema(vocabulary_schema(tmp_path, min_count=3))
    data = ratings(tmp_path / "d", 0)
    (data / "part_0.csv").write_text("label,user_id,movie_id,genres,occupation,age,year\n" + "".join(
        f"1,1,1,{g},{o},30,1990\n" for g, o in [("War|Drama", 1), ("War", 2), ("War|Drama", 3), ("Drama|Crime", 1),
                                                 ("Crime", 1), ("Crime", 4), ("Western", 5), ("War", 6)]))
    rows = list(rows_of(schema, [data / "part_0.csv"]))
    built = vocabularies(schema, named(schema, rows))
    tables = {t.name: t for t in built.tables}
    # War x4, Drama x3, Crime x3 (ties in the values' order), Western x1 below min_count 3.
    assert tables["genre"].values == ("War", "Crime", "Drama")
    # occupation: 7 rows, 6 values at most, the most named first; "1" x3, then the others once each.
    assert tables["occupation"].values == ("1", "2", "3", "4", "5", "6") and tables["user"].values is None
    encoder = Encoder(built, {"age": (30.0, 1.0)})
    batch = encoder.batch(rows)
    assert batch.sparse["genres"].values.tolist() == [1, 3, 1, 1, 3, 3, 2, 2, 2, 0, 1]
    with pytest.raises(ValueError, match="table genre, occupation takes its vocabulary from the data"):
        Encoder(schema, {"age": (30.0, 1.0)})
    o = {x.table: x for x in occupancy(built, rows)}
    assert (o["genre"].distinct, o["genre"].rows_used, o["genre"].sharing) == (4, 4, 0), "Western alone on row 0"
    # The model runs forward over a vocabulary of the sample's; every value has a row: nothing to warn of.
    assert preflight(settings(data, eval_samples=2).model_copy(update={"schema_file": vocabulary_schema(tmp_path)})) \
        == []
    with pytest.raises(ValueError, match="a vocabulary gives values rows 1 .. rows - 1, a hashed table"):
        rpcps_table(name="t", rows=4, dim=2, vocabulary=True, hashed=True)
    with pytest.raises(ValueError, match="3 values, at most rows - 1 = 2"):
        rpcps_table(name="t", rows=3, dim=2, vocabulary=True, values=("a", "b", "c"))


def test_a_vocabulary_without_rows_sizes_itself_from_the_count_and_a_cap_does_not_change_the_model(tmp_path):
    from rpcps.data.statistics import named, vocabularies
    from rpcps.tables import EmbeddingBags
    data = ratings(tmp_path / "d", 400)
    text = vocabulary_schema(tmp_path).read_text()
    sizes = {}
    for name, genre in (("capped", "rows: 1000, dim: 8"), ("sized", "dim: 8")):
        (tmp_path / f"{name}.yaml").write_text(text.replace("rows: 32, dim: 8", genre))
        schema = load_schema(tmp_path / f"{name}.yaml")
        built = {t.name: t for t in vocabularies(schema, named(schema, rows_of(schema, [data / "part_0.csv"]))).tables}
        sizes[name] = built["genre"]
        warned = preflight(settings(data, eval_samples=100).model_copy(update={"schema_file": tmp_path / f"{name}.yaml"}))
        assert not [w for w in warned if w.startswith("table genre")], warned
    assert sizes["sized"].rows == 19 and sizes["capped"].rows == 1000 and sizes["sized"].values == sizes["capped"].values
    ids = torch.arange(19)
    first = [EmbeddingBags([sizes[n]], seed=3).initial_rows("genre", ids) for n in ("sized", "capped")]
    assert torch.equal(first[0], first[1]), "the same initial rows, capped or not"
    assert sizes["sized"].scale == 1 / 19 ** 0.5
    with pytest.raises(ValueError, match="table genre: give its rows"):
        rpcps_table(name="genre", dim=8)
    with pytest.raises(ValueError, match="table genre takes its vocabulary from the data, which rpcps up counts"):
        _ = rpcps_table(name="genre", dim=8, vocabulary=True).scale
    assert rpcps_table(name="genre", dim=8, vocabulary=True, values=("a", "b")).rows == 3


def test_up_records_the_vocabulary_counted_over_every_training_line(tmp_path):
    from trainer.ctr.preflight import recorded_schema
    data = ratings(tmp_path / "d", 400)
    cfg = settings(data, eval_samples=100).model_copy(update={"schema_file": vocabulary_schema(tmp_path)})
    written = load_schema(recorded_schema(cfg, tmp_path / "state"))
    tables = {t.name: t for t in written.tables}
    counted = named(load_schema(cfg.schema_file), rows_of(load_schema(cfg.schema_file), [data / "part_0.csv"],
                                                          start=100))
    assert set(tables["genre"].values) == set(counted["genre"]) and len(tables["genre"].values) == 18
    top = counted["occupation"].most_common(1)[0][0]
    assert len(tables["occupation"].values) == 7 and tables["occupation"].values[0] == top
    assert "table genre: 18 values named 1 times at least, counted from data line 100 on" in \
        (tmp_path / "state" / "schema.yaml").read_text()
