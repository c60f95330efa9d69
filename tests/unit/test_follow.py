"""A followed folder (``--follow``): files trained on in name order as they land, each once, divided
among trainers into equal numbers of batches; a position resumes with no record replayed and none
lost; each file's first share held out and evaluated newest first; how far behind is said."""
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rpcps
from rpcps.data.follow import FollowSource
from rpcps.data.builders import Follow, schema_source

SCHEMA = """\
format: {fmt}
label: y
numeric:
  - {{column: x}}
categorical:
  - {{column: item, table: item}}
tables:
  - {{name: item, rows: 50, dim: 4}}
"""


def land(folder, name, xs, fmt):
    """A file of records x in ``xs``, written aside and renamed into place, as a producer lands one."""
    partial = folder / f".{name}.partial"
    if fmt == "csv":
        partial.write_text("y,x,item\n" + "".join(f"{x % 2},{x},i{x % 7}\n" for x in xs))
    else:
        pq.write_table(pa.table({"y": [x % 2 for x in xs], "x": list(xs), "item": [f"i{x % 7}" for x in xs]}),
                       partial, row_group_size=4)
    os.rename(partial, folder / name)


def follow(tmp_path, fmt, share=0, shares=1, held=0.0, batch_size=4):
    (tmp_path / "s.yaml").write_text(SCHEMA.format(fmt=fmt))
    schema = rpcps.load_schema(tmp_path / "s.yaml")
    source = schema_source(schema, tmp_path / "in", batch_size, 0, share, shares, follow=Follow(held))
    assert isinstance(source, FollowSource)
    return source


def drain(source):
    """Every batch it has now, as the records' x."""
    out = []
    while source.ready(0):
        out += [int(v) for v in source.next().dense[:, 0]]
    return out


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_files_are_trained_on_in_name_order_as_they_land_each_once(tmp_path, fmt):
    (tmp_path / "in").mkdir()
    source = follow(tmp_path, fmt)
    assert not source.ready(0.05) and source.state() == {"file": None, "record": 0}
    land(tmp_path / "in", "0001.f", range(0, 10), fmt)
    assert drain(source) == list(range(10)) and source.state() == {"file": "0001.f", "record": 10}
    assert not source.ready(0)
    land(tmp_path / "in", "0003.f", range(20, 25), fmt)
    land(tmp_path / "in", "0002.f", range(10, 20), fmt)
    assert drain(source) == list(range(10, 25)) and source.state() == {"file": "0003.f", "record": 5}
    land(tmp_path / "in", "0000.f", range(100, 105), fmt)       # named before one already read: left unread
    land(tmp_path / "in", "0004.f", range(25, 28), fmt)
    assert drain(source) == [25, 26, 27]
    with pytest.raises(LookupError, match="no file has landed past 0004.f yet"):
        source.next()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_trainers_share_each_file_in_the_same_number_of_batches(tmp_path, fmt):
    (tmp_path / "in").mkdir()
    sources = [follow(tmp_path, fmt, k, 3, batch_size=4) for k in range(3)]
    land(tmp_path / "in", "a", range(0, 29), fmt)          # 29 records: shares of 10, 10 and 9, in 3 batches each
    batches = [[] for _ in sources]
    for k, source in enumerate(sources):
        while source.ready(0):
            batches[k].append([int(v) for v in source.next().dense[:, 0]])
    assert [len(b) for b in batches] == [3, 3, 3], batches
    assert sources[0].batch_size_for(25) == 5, "shares of 8, 8 and 9: 4 a batch gives 2, 2 and 3 batches; 5 gives 2"
    assert sorted(x for b in batches for batch in b for x in batch) == list(range(29))
    assert batches[1][0] == [1, 4, 7, 10], "trainer k of n takes records k, k + n, …"


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_position_resumes_with_no_record_replayed_or_lost(tmp_path, fmt):
    (tmp_path / "in").mkdir()
    land(tmp_path / "in", "a", range(0, 13), fmt)
    land(tmp_path / "in", "b", range(13, 20), fmt)
    whole = drain(follow(tmp_path, fmt, 1, 2, batch_size=2))
    first = follow(tmp_path, fmt, 1, 2, batch_size=2)
    before = [int(v) for v in first.next().dense[:, 0]]
    assert first.state() == {"file": "a", "record": 8}, "batches of 4: 2 would give 4 batches to 7 records, 3 to 6"
    again = follow(tmp_path, fmt, 1, 2, batch_size=2)
    assert "record" in again.restore([first.state()], first.state())
    assert before + drain(again) == whole == [1, 3, 5, 7, 9, 11, 14, 16, 18], "each file's records 1, 3, …"
    # The trainers divided anew (2 saved, 3 now): every one goes on from the earliest position.
    other = follow(tmp_path, fmt, 0, 2, batch_size=2)
    other.next()
    states = [first.state(), other.state()]
    third = follow(tmp_path, fmt, 0, 3, batch_size=2)
    third.restore(states, None)
    assert third.state() == min(states, key=lambda s: (s["file"], s["record"]))


def test_each_files_first_share_is_held_out_and_evaluated_newest_first(tmp_path):
    (tmp_path / "in").mkdir()
    source = follow(tmp_path, "csv", held=0.2)
    land(tmp_path / "in", "a", range(0, 10), "csv")
    land(tmp_path / "in", "b", range(10, 20), "csv")
    assert drain(source) == [*range(2, 10), *range(12, 20)]
    assert [int(v) for b in source.held_out(3, 2) for v in b.dense[:, 0]] == [10, 11, 0]
    assert "each file's first 20% held out" in source.description


def test_behind_says_what_landed_and_was_not_reached(tmp_path):
    (tmp_path / "in").mkdir()
    source = follow(tmp_path, "csv", batch_size=5)
    land(tmp_path / "in", "a", range(0, 10), "csv")
    land(tmp_path / "in", "b", range(10, 16), "csv")
    os.utime(tmp_path / "in" / "a", (time.time() - 30, time.time() - 30))
    records, seconds = source.behind()
    assert records == 16 and 29 < seconds < 60
    source.next()
    source._behind = (float("-inf"), (0, 0.0))          # counted again at once, not a second later
    assert source.behind()[0] == 11
    drain(source)
    source._behind = (float("-inf"), (0, 0.0))
    assert source.behind() == (0, 0.0)


def test_a_file_that_cannot_be_read_is_skipped_and_the_stream_goes_on(tmp_path):
    (tmp_path / "in").mkdir()
    source = follow(tmp_path, "parquet")
    (tmp_path / "in" / "a").write_text("not parquet\n")
    land(tmp_path / "in", "b", range(0, 6), "parquet")
    assert drain(source) == list(range(6))
    assert source.skipped == 1 and "a: not a readable Parquet file" in source.last_skip


def test_lists_cut_are_counted_once_across_files(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "s.yaml").write_text(SCHEMA.format(fmt="csv").replace("{column: item, table: item}",
                                                                      "{column: item, table: item, separator: '|'}"))
    source = schema_source(rpcps.load_schema(tmp_path / "s.yaml"), tmp_path / "in", 4, 0, follow=Follow())
    for name in ("a", "b"):
        (tmp_path / "in" / name).write_text("y,x,item\n1,1,p|q\n0,2,p\n")
        drain(source)
        assert source.truncated == (1 if name == "a" else 2)


def test_a_followed_folder_may_be_empty_and_only_its_newest_files_are_checked(tmp_path):
    from rpcps.data.files import FOLLOWED_CHECKED, checked_data
    (tmp_path / "s.yaml").write_text(SCHEMA.format(fmt="csv"))
    schema, folder = rpcps.load_schema(tmp_path / "s.yaml"), tmp_path / "in"
    folder.mkdir()
    checked_data(folder, schema, follow=True)
    with pytest.raises(ValueError, match="holds no data files"):
        checked_data(folder, schema)
    (folder / "0000").write_text("y,x,item\n7,1,a\n")            # read long ago, maybe
    for k in range(1, FOLLOWED_CHECKED + 1):
        land(folder, f"{k:04d}", range(3), "csv")
    checked_data(folder, schema, follow=True)
    (folder / f"{FOLLOWED_CHECKED + 1:04d}").write_text("y,x,item\n7,1,a\n")
    with pytest.raises(ValueError, match="the label y must be a number in"):
        checked_data(folder, schema, follow=True)


def test_follow_is_refused_with_dense_allreduce(tmp_path):
    from services.config import load
    from services.errors import ConfigError
    from trainer.ctr.config import CtrTrainerConfig
    (tmp_path / "in").mkdir()
    with pytest.raises(ConfigError, match="--follow with --dense allreduce: a trainer waiting for the next file"):
        load(CtrTrainerConfig, {"data": str(tmp_path / "in"), "follow": "true", "dense": "allreduce",
                                "consistency": "sync"}, {})


def test_a_trainer_waiting_for_data_leaves_the_step_clock_and_tells_where_it_is_once():
    # In sync mode a waiting trainer must hold nobody's step: one with a batch more of a file, or a
    # replacement a step out of phase, steps on; it tells its position before its state says "waiting".
    from services.lifecycle import RoleState, StatusBoard
    from trainer.core.data_wait import DataWait
    said = []

    class Loop:
        answers = [True, False, False, True]

        def ready(self, wait):
            said.append(f"ready {wait}")
            return self.answers.pop(0)
    board = StatusBoard("ctr", "ctr0")
    board.set_state(RoleState.RUNNING, "episode 1")
    wait = DataWait(Loop(), board, tell=lambda: said.append(f"tell ({board.snapshot()['reason']})"),
                    leave=lambda: said.append("leave"))
    assert [wait.ready() for _ in range(4)] == [True, False, False, True]
    assert said == ["ready 0.0", "ready 0.0", "leave", "tell (episode 1)", f"ready {DataWait.SLICE}",
                    f"ready {DataWait.SLICE}"]
    assert board.snapshot()["reason"] == "episode 1"
