"""A source of your own: ``rpcps.data.Records`` encodes a record as the same line of a file is
encoded, refuses a bad one naming it; ``--source`` is loaded with a sentence for each mistake."""
import pytest

import rpcps.data
import torch

import rpcps
from rpcps.data import Records
from rpcps.data.lines import LineError
from rpcps.data.source import load_source
from rpcps.model import ModelError
from tests.support.cluster import REPO
from tests.support.queue_source import RatingsQueue

SCHEMA = REPO / "tests" / "support" / "ratings_schema.yaml"


def schema():
    loaded = rpcps.load_schema(SCHEMA)
    return loaded.model_copy(update={"numeric": tuple(n.model_copy(update={"mean": 38.0, "std": 12.0})
                                                      if n.column == "age" else n for n in loaded.numeric)})


def test_a_record_is_encoded_as_the_same_line_of_a_file(tmp_path):
    s = schema()
    (tmp_path / "d.csv").write_text("label,user_id,movie_id,genres,occupation,age,year\n1,7,3,Drama|War,4,31,1994\n"
                                    "0,8,,Comedy,5,,1960\n")
    from_file = next(rpcps.batches(s, tmp_path / "d.csv", 2))
    from_records = Records(s).batch([
        {"label": 1, "user_id": 7, "movie_id": 3, "genres": ["Drama", "War"], "occupation": 4, "age": 31, "year": 1994},
        {"label": 0, "user_id": "8", "movie_id": None, "genres": "Comedy", "occupation": 5, "age": None, "year": 1960}])
    assert torch.equal(from_file.dense, from_records.dense) and torch.equal(from_file.labels, from_records.labels)
    for name in from_file.sparse:
        assert torch.equal(from_file.sparse[name].values, from_records.sparse[name].values), name
        assert torch.equal(from_file.sparse[name].offsets, from_records.sparse[name].offsets), name


@pytest.mark.parametrize("change,message", [
    ({"label": 3}, "record 0: the label label must be a number in [0, 1], got 3"),
    ({"age": "old"}, "record 0: column age is not a number: 'old'"),
    ({"year": float("inf")}, "record 0: column year is not a finite number: inf"),
])
def test_a_bad_record_is_refused_naming_it(change, message):
    record = {"label": 1, "user_id": 7, "movie_id": 3, "genres": [], "occupation": 4, "age": 31, "year": 1994}
    with pytest.raises(LineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Records(schema()).batch([{**record, **change}])
    with pytest.raises(LineError, match="record 0: no column year"):
        Records(schema()).batch([{k: v for k, v in record.items() if k != "year"}])


class Half:
    def __init__(self, schema, share, shares, batch_size):
        self.description = "half a source"

    def next(self):
        return None


class Broken:
    def __init__(self, schema, share, shares, batch_size):
        raise RuntimeError("no broker at localhost:9092")


def test_a_source_is_loaded_or_refused_with_a_sentence():
    source = load_source("tests.support.queue_source:RatingsQueue", schema(), 1, 2, 4)
    assert isinstance(source, RatingsQueue) and source.state() == {"offset": 1}
    assert len(source.next()) == 4 and source.state() == {"offset": 9}
    with pytest.raises(ModelError, match="--source tests.unit.test_sources:Half: a source has description, .*; "
                                         "Half lacks skipped, last_skip, truncated, ready, held_out, state, "
                                         "restore, behind"):
        load_source("tests.unit.test_sources:Half", schema(), 0, 1, 4)
    with pytest.raises(ModelError, match=r"Broken\(schema, share, shares, batch_size\) raised RuntimeError: no broker"):
        load_source("tests.unit.test_sources:Broken", schema(), 0, 1, 4)
    with pytest.raises(ModelError, match="--source nowhere: give it as module:Class"):
        load_source("nowhere", schema(), 0, 1, 4)
    # Over rpcps.data.BaseSource, a source writes four methods; the rest have their defaults.
    assert source.ready(0.0) and source.behind() is None and (source.skipped, source.last_skip) == (0, None)
    assert source.description == "the tests' ratings queue" and (source.share, source.shares) == (1, 2)


class Unfinished(rpcps.data.BaseSource):
    def next(self):
        return None


def test_a_base_source_says_which_of_its_four_methods_is_not_written():
    source = load_source("tests.unit.test_sources:Unfinished", schema(), 0, 1, 4)
    assert source.description == "Unfinished" and source.truncated == 0 and source.next() is None
    with pytest.raises(NotImplementedError, match="Unfinished.state: where it is, as JSON"):
        source.state()
