"""Parquet files (``format: parquet``): the same records as CSV give the same batches, on any
number of trainers however the files were cut into row groups; a position resumes exactly; every bad value is skipped and counted
with its file, record and column, and a bad file is refused before anything starts or skipped
while training, never a crash."""
import argparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import rpcps
from rpcps.data.files import checked_data, data_files
from rpcps.data.lines import LineError
from rpcps.data.parquet import ParquetStream
from rpcps.data.source import FileSource
from rpcps.data.encoding import Encoder
from rpcps.data.statistics import check, named, rows_of, vocabularies
from tests.support.cluster import REPO
from trainer.ctr import datagen_ratings

SCHEMA = """\
format: parquet
label: y
numeric:
  - {column: x}
  - {column: price, fill: 1, clip: [0, 100], log1p: true}
categorical:
  - {column: item, table: item}
  - {column: tags, table: item, max_length: 2}
tables:
  - {name: item, rows: 50, dim: 4}
"""


def schema(tmp_path, text=SCHEMA):
    (tmp_path / "s.yaml").write_text(text)
    return rpcps.load_schema(tmp_path / "s.yaml")


def write(path, records, row_group=4, **columns):
    """``records`` records: x is the record's number, so a batch says which records it holds."""
    table = {"y": [i % 2 for i in range(records)], "x": list(range(records)),
             "price": [float(i) for i in range(records)], "item": [f"i{i % 7}" for i in range(records)],
             "tags": [[f"t{i % 3}", f"t{i % 5}"] for i in range(records)], **columns}
    pq.write_table(pa.table(table), path, row_group_size=row_group)
    return path


def xs(batches):
    return [int(v) for b in batches for v in b.dense[:, 0]]


def test_the_same_records_as_csv_give_the_same_batches(tmp_path):
    # The movies example's schema, its format the only change, over `rpcps data ratings` in both formats.
    for fmt in ("csv", "parquet"):
        datagen_ratings.run(argparse.Namespace(rows=3000, out=tmp_path / fmt, files=2, gzip=False, users=300,
                                               movies=200, seed=4, format=fmt, row_group=700))
    text = (REPO / "examples/movies_deepfm/movies.yaml").read_text()
    csv = schema(tmp_path, text)
    parquet = schema(tmp_path, text.replace("format: csv", "format: parquet"))
    tables = vocabularies(csv, named(csv, rows_of(csv, data_files(tmp_path / "csv")))).tables
    assert vocabularies(parquet, named(parquet, rows_of(parquet, data_files(tmp_path / "parquet")))).tables == tables
    csv, parquet = (s.model_copy(update={"tables": tables}) for s in (csv, parquet))
    pairs = list(zip(rpcps.batches(csv, tmp_path / "csv", 512), rpcps.batches(parquet, tmp_path / "parquet", 512),
                     strict=True))
    assert len(pairs) == 6
    for a, b in pairs:
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        for name in a.sparse:
            assert torch.equal(a.sparse[name].values, b.sparse[name].values), name
            assert torch.equal(a.sparse[name].offsets, b.sparse[name].offsets), name


def test_records_are_divided_among_trainers_however_the_files_were_cut(tmp_path):
    s = schema(tmp_path)
    write(tmp_path / "a.parquet", 10, row_group=4)             # groups of records 0-3, 4-7, 8-9
    write(tmp_path / "b.parquet", 6, row_group=4, x=list(range(10, 16)))
    paths, encoder = data_files(tmp_path), Encoder(s)
    shares = [xs(ParquetStream(s, paths, k, 2, encoder=encoder).batches(3)) for k in range(2)]
    assert shares == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert xs(ParquetStream(s, paths, 1, 2, start=5, stop=12, encoder=encoder).batches(3)) == [5, 7, 9, 11]
    # One row group a file, as pandas and pyarrow write by default: three trainers each take a third.
    (tmp_path / "one").mkdir()
    whole = write(tmp_path / "one" / "c.parquet", 10, row_group=1 << 20)
    thirds = [xs(ParquetStream(s, [whole], k, 3, start=1, encoder=encoder).batches(2)) for k in range(3)]
    assert thirds == [[3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_a_position_resumes_with_no_record_replayed_or_lost(tmp_path):
    s = schema(tmp_path)
    write(tmp_path / "a.parquet", 23, row_group=5)
    write(tmp_path / "b.parquet", 17, row_group=5, x=list(range(23, 40)))
    encoder = Encoder(s)

    def source(share):
        return FileSource("parquet", lambda k, n, start, stop: ParquetStream(s, data_files(tmp_path), k, n, start,
                                                                              stop, encoder=encoder),
                          batch_size=4, held=3, share=share, shares=2)
    for share in range(2):
        whole, first = source(share), source(share)
        everything = [x for _ in range(6) for x in xs([whole.next()])]
        before = [x for _ in range(2) for x in xs([first.next()])]
        resumed = source(share)
        resumed.restore([first.state()], first.state())
        after = [x for _ in range(4) for x in xs([resumed.next()])]
        assert before + after == everything, share
        assert min(everything) >= 3          # the held-out records are never trained on
    together = sorted(x for share in range(2) for x in xs(source(share).open(share, 2, 3, None).batches(4)))
    assert together == list(range(3, 40))


def test_every_bad_value_is_skipped_and_counted_with_its_file_record_and_column(tmp_path):
    s = schema(tmp_path)
    path = write(tmp_path / "a.parquet", 8, row_group=3,
                 y=[0, 2, 1, None, 0, 1, 0, 1],
                 x=[0, 1, 2, 3, float("nan"), 5, float("inf"), 7],
                 price=[0.0, 1, 2, 3, 4, -5.0, 6, None])
    stream = ParquetStream(s, [path], encoder=Encoder(s))
    assert xs(stream.batches(10)) == [0, 2, 5, 7]         # price -5 is clipped to 0 before log1p: fine
    assert stream.skipped == 4
    assert stream.reasons == [f"{path}:2: the label y must be a number in [0, 1], got 2",
                              f"{path}:4: the label y must be a number in [0, 1], got None",
                              f"{path}:5: column x is not a finite number: nan",
                              f"{path}:7: column x is not a finite number: inf"]
    with pytest.raises(LineError, match=f"{path}:2: the label y must be a number in"):
        check(s, [path], 100)
    rows = rows_of(s, [path], logged=False)
    assert [r.numeric[0] for r in rows] == [0, 2, 5, 7] and rows.reasons == stream.reasons


def test_a_bad_file_is_refused_before_anything_starts_and_skipped_while_training(tmp_path):
    root, s, tmp_path = tmp_path, schema(tmp_path), tmp_path / "data"
    tmp_path.mkdir()
    write(tmp_path / "b.parquet", 5)
    (tmp_path / "a.parquet").write_text("label,x\n1,2\n")
    with pytest.raises(ValueError, match=r"a.parquet: not a readable Parquet file"):
        checked_data(tmp_path, s)
    stream = ParquetStream(s, data_files(tmp_path), encoder=Encoder(s))
    assert xs(stream.batches(10)) == [0, 1, 2, 3, 4] and stream.skipped == 1
    assert "a.parquet: not a readable Parquet file" in stream.last_skip and "whole file is skipped" in stream.last_skip
    pq.write_table(pa.table({"y": [1], "x": [2]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="a.parquet: has no column price, item, tags"):
        checked_data(tmp_path, s)
    write(tmp_path / "a.parquet", 3, item=[1.5, 2.0, None], tags=[["a"], ["b"], []])
    assert [b.sparse["item"].offsets.tolist() for b in rpcps.batches(s, tmp_path / "a.parquet", 3)] == [[0, 1, 2, 2]]
    write(tmp_path / "a.parquet", 3, x=["1", "2", "3"])
    with pytest.raises(ValueError, match="a.parquet: column x holds string, not numbers"):
        checked_data(tmp_path, s)
    unbounded = schema(root, SCHEMA.replace("{column: tags, table: item, max_length: 2}",
                                            "{column: tags, table: item}"))
    write(tmp_path / "a.parquet", 3)
    with pytest.raises(ValueError, match="column tags holds lists: give its max_length"):
        checked_data(tmp_path, unbounded)
    with pytest.raises(rpcps.SchemaError, match="header: Parquet files name their columns; leave it out"):
        schema(root, SCHEMA + "header: false\n")


def test_lists_are_truncated_and_counted_and_a_separator_splits_text(tmp_path):
    s = schema(tmp_path, SCHEMA.replace("{column: item, table: item}", "{column: item, table: item, separator: '|', "
                                                                          "max_length: 2}"))
    path = write(tmp_path / "a.parquet", 3, item=["a|b|c", " a |", None], tags=[["x", "y", "z"], [None, " "], None])
    stream = ParquetStream(s, [path], encoder=Encoder(s))
    batch = next(stream.batches(3))
    assert batch.sparse["item"].offsets.tolist() == [0, 2, 3, 3]
    assert batch.sparse["tags"].offsets.tolist() == [0, 2, 2, 2]
    assert stream.truncated == 2
    rows = list(rows_of(s, [path]))
    assert [r.categorical for r in rows] == [["a|b|c", ["x", "y", "z"]], [" a |", [" "]], ["", []]]


def test_bench_read_reports_both_formats_over_the_same_records():
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "supervise.cli", "bench", "read", "--rows", "3000", "--repeats", "1",
                        "--row-group", "1000"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["csv"]["records"] == out["parquet"]["records"] == 3000 and out["same_batches"], out
    assert out["parquet"]["bytes"] < out["csv"]["bytes"] and out["csv"]["records_per_cpu_s"] > 0, out
    assert set(out["met"]) == {"parquet_at_least_csv", "same_batches"}, out
