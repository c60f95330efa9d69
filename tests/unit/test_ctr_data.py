"""CTR data: the generator's determinism and distribution, the Criteo reader's every failure, and
the quality measures against brute force."""
from __future__ import annotations

import gzip
import itertools
import re

import numpy as np
import pytest

from rpcps.data.criteo import MAX_LINE, CriteoError, CriteoStream, check, write
from rpcps.data.generated import CALIBRATED_FROM, KAGGLE_CARDINALITIES, TEST_OFFSET, SyntheticCtr
from rpcps.quality import auc, expected_auc, logloss

SMALL = SyntheticCtr(seed=3, scale=0.01)


def test_a_sample_is_a_pure_function_of_seed_and_index():
    whole = SMALL.batch(np.arange(0, 64))
    part = SMALL.batch(np.arange(40, 50))
    again = SyntheticCtr(seed=3, scale=0.01).batch(np.arange(40, 50))
    for a, b in ((whole.ids[40:50], part.ids), (whole.labels[40:50], part.labels), (part.p, again.p),
                 (whole.dense[40:50], again.dense)):
        assert np.array_equal(a, b)
    other = SyntheticCtr(seed=4, scale=0.01).batch(np.arange(40, 50))
    assert not np.array_equal(other.ids, part.ids)


def test_shares_are_disjoint_and_whole():
    shares = [SyntheticCtr.share(100, 1000, k, 3) for k in range(3)]
    together = np.concatenate(shares)
    assert len(together) == 1000 and set(together.tolist()) == set(range(100, 1100))
    assert SMALL.held_out(1000).min() >= TEST_OFFSET > 10**12        # far past any training share


def test_tables_and_ids_have_criteo_shapes():
    assert sum(KAGGLE_CARDINALITIES) == 33_762_577 and len(KAGGLE_CARDINALITIES) == 26
    assert SyntheticCtr(scale=1.0).cardinalities == KAGGLE_CARDINALITIES
    b = SMALL.batch(np.arange(5000))
    assert b.ids.shape == (5000, 26) and b.dense.shape == (5000, 13)
    assert (b.ids >= 0).all() and (b.ids < np.array(SMALL.cardinalities)).all()
    assert 0.05 < (b.counts < 0).mean() < 0.15                      # missing counts, as in Criteo


def test_about_one_percent_of_a_big_tables_rows_take_ninety_percent_of_lookups():
    g = SyntheticCtr(seed=1)
    ranks = g.ranks(np.arange(100_000))
    for f, rows in enumerate(g.cardinalities):
        if rows >= CALIBRATED_FROM:
            share = (ranks[:, f] < rows // 100).mean()
            assert 0.87 < share < 0.93, (f, rows, share)
    ids = g.ids(np.arange(20_000))[:, 2]            # hot rows are scattered, not all on one server
    hot = np.unique(ids, return_counts=True)
    top = hot[0][np.argsort(hot[1])[-200:]]
    assert len(set((top % 4).tolist())) == 4


def test_labels_follow_the_ground_truth_at_criteo_rates():
    g = SyntheticCtr(seed=1, scale=0.1)
    b = g.batch(g.held_out(40_000))
    assert abs(b.labels.mean() - 0.256) < 0.01
    assert abs(auc(b.p, b.labels) - 0.80) < 0.015
    assert abs(logloss(np.full(len(b.labels), b.labels.mean()), b.labels) - 0.569) < 0.01


def test_auc_against_every_pair():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 8, 300).astype(float)          # many ties
    labels = rng.random(300) < 0.3
    pairs = [(1.0 if s > t else 0.5 if s == t else 0.0)
             for (s, y), (t, z) in itertools.product(zip(scores, labels), repeat=2) if y and not z]
    assert auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))
    assert auc([0.1, 0.9], [0, 1]) == 1.0 and auc([0.9, 0.1], [0, 1]) == 0.0 and np.isnan(auc([1, 2], [1, 1]))
    p = rng.random(2000)
    draws = [auc(p, rng.random(2000) < p) for _ in range(200)]
    assert expected_auc(p) == pytest.approx(np.mean(draws), abs=0.003)


GOOD = "1\t5\t\t3\t0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t" + "\t".join(["68fd1e64"] * 25 + [""])


@pytest.mark.parametrize("content, says", [
    (GOOD + "\n0\t1\t2\n", ":2: expected 40 tab-separated fields (label, 13 counts, 26 categorical values), found 3"),
    (GOOD.replace("\t5\t", "\tfive\t", 1) + "\n", ":1: count I1 (field 2) is not an integer: 'five'"),
    (GOOD.replace("68fd1e64", "68fd1e6z", 1) + "\n",
     ":1: categorical C1 (field 15) is not 1 to 8 hexadecimal digits: '68fd1e6z'"),
    ("2" + GOOD[1:] + "\n", ":1: the label (field 1) must be 0 or 1, got '2'"),
    (GOOD.encode() + b"\n" + GOOD.encode()[:20] + b"\xe9" + GOOD.encode()[21:] + b"\n",
     ":2: not UTF-8 text (byte 0xe9 at column 21)"),
    ("", " is empty"),
])
def test_every_way_a_file_can_be_wrong_is_a_sentence(tmp_path, content, says):
    path = tmp_path / "day_0"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CriteoError) as e:
        check([path])
    assert str(e.value) == f"{path}{says}" or str(e.value).startswith(f"{path}") and says in str(e.value)


HUGE = "7" * 10_000_000       # a 10 MB field


def _with(field: int, value: str) -> str:
    """GOOD with its field ``field`` (0: the label) set to ``value``."""
    fields = GOOD.split("\t")
    fields[field] = value
    return "\t".join(fields)


# Every value a field can hold is read or refused in a sentence; none crashes the reader.
MALFORMED = [
    (_with(1, "1" * 22), "count I1 (field 2) does not fit in 64 bits: '1111111111111111111111'"),
    (_with(3, "-" + "9" * 19), "count I3 (field 4) does not fit in 64 bits"),
    (_with(2, "1_000"), "count I2 (field 3) is not an integer: '1_000'"),
    (_with(2, "+7"), "count I2 (field 3) is not an integer: '+7'"),
    (_with(2, "\u0663"), "count I2 (field 3) is not an integer: '\u0663'"),
    (_with(5, "1e5"), "count I5 (field 6) is not an integer: '1e5'"),
    (_with(2, "\ufeff5"), "count I2 (field 3) is not an integer: '\\ufeff5'"),     # a byte-order mark mid-file
    (_with(14, "0x1f"), "categorical C1 (field 15) is not 1 to 8 hexadecimal digits: '0x1f'"),
    (_with(14, "1" + "0" * 8), "categorical C1 (field 15) is not 1 to 8 hexadecimal digits: '100000000'"),
    (_with(0, "1" + "\x00" * 3), "the label (field 1) must be 0 or 1, got '1\\x00\\x00\\x00'"),
    (_with(2, "9" * 3000), "count I2 (field 3) does not fit in 64 bits: "
     "'9999999999999999999999999999999999999999'… (3,000 characters)"),
    (_with(2, HUGE), f"the line is {len(_with(2, HUGE)):,} bytes long; a line may have at most {MAX_LINE:,}"),
]


@pytest.mark.parametrize("line, says", MALFORMED, ids=range(len(MALFORMED)))
def test_every_value_a_line_can_hold_is_a_bounded_sentence_at_start(tmp_path, line, says):
    path = tmp_path / "day_0"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(CriteoError) as e:
        check([path])
    assert says in str(e.value) and str(e.value).startswith(f"{path}:1: ")
    assert len(str(e.value)) < len(str(path)) + 200, "a message quotes a bounded part of the value"


def test_every_value_a_line_can_hold_is_skipped_and_counted_while_training(tmp_path, caplog):
    path = tmp_path / "day_0"
    bad = [line for line, _ in MALFORMED]
    with open(path, "w", encoding="utf-8") as f:
        for line in bad:            # a good line before each bad one, and the last line a good one without "\n"
            f.write(GOOD + "\n" + line + "\n")
        f.write(GOOD)
    stream = CriteoStream([path], SMALL.cardinalities)
    batches = list(stream.batches(4))
    assert sum(len(b.labels) for b in batches) == len(bad) + 1
    assert stream.skipped == len(bad) and len(stream.last_skip) < len(str(path)) + 200
    assert all(np.isfinite(b.dense).all() for b in batches)
    assert max(len(r.getMessage()) for r in caplog.records) < len(str(path)) + 300


def test_a_byte_order_mark_and_negative_counts_are_read(tmp_path):
    plain, packed = tmp_path / "day_0", tmp_path / "day_1.gz"
    line = _with(2, "-3") + "\n"
    plain.write_bytes(b"\xef\xbb\xbf" + line.encode() * 2)
    with gzip.open(packed, "wb") as f:
        f.write(b"\xef\xbb\xbf" + line.encode())
    check([plain, packed])
    batch = next(CriteoStream([plain, packed], SMALL.cardinalities).batches(3))
    assert len(batch.labels) == 3 and (batch.counts[:, 1] == -3).all() and (batch.dense[:, 1] == 0).all()


def test_a_file_of_malformed_lines_logs_a_bounded_number_of_lines(tmp_path, caplog):
    path = tmp_path / "day_0"
    path.write_text((_with(2, "x") + "\n") * 5000 + GOOD + "\n")
    stream = CriteoStream([path], SMALL.cardinalities)
    assert sum(len(b.labels) for b in stream.batches(10)) == 1 and stream.skipped == 5000
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert 10 <= len(said) <= 12 and "(10 skipped so far)" in said[9]


def test_a_truncated_gzip_stream_is_a_sentence_and_skipped_while_training(tmp_path):
    good = tmp_path / "day_0.gz"
    with gzip.open(good, "wt") as f:
        write(SMALL, np.arange(3000), f)
    cut = tmp_path / "day_1.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    check([good], lines=10**6)
    with pytest.raises(CriteoError, match=r"day_1.gz: cannot be read past line \d+: the gzip stream is truncated"):
        check([cut], lines=10**6)
    stream = CriteoStream([cut, good], SMALL.cardinalities)
    read = sum(len(b.labels) for b in stream.batches(512))
    assert stream.skipped == 1 and "truncated" in stream.last_skip and 3000 < read < 6000


def test_written_data_reads_back_in_disjoint_shares(tmp_path):
    path = tmp_path / "day_0"
    with open(path, "w") as f:
        assert write(SMALL, np.arange(1000), f) == 1000
    bad = tmp_path / "day_1"
    bad.write_text(GOOD + "\n" + "1\tx\n" + GOOD + "\n")
    check([path, bad], lines=1)
    labels = []
    skipped = 0
    for share in range(3):
        stream = CriteoStream([path, bad], SMALL.cardinalities, share, 3)
        got = list(stream.batches(100))
        labels.append(np.concatenate([b.labels for b in got]))
        skipped += stream.skipped
        assert all((b.ids < np.array(SMALL.cardinalities)).all() for b in got)
    assert skipped == 1 and sum(len(x) for x in labels) == 1002
    assert np.array_equal(np.concatenate([labels[0][:334], ]), SMALL.batch(np.arange(0, 1000, 3)).labels[:334])


def test_a_data_path_that_cannot_be_opened_says_why(tmp_path):
    from pydantic import ValidationError
    from trainer.ctr.config import CtrDataSettings
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "nowhere")
    for path, says in [(loop, f"{loop} is a loop of symbolic links"),
                       (dangling, f"{dangling} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist"),
                       (tmp_path / "absent", f"{tmp_path / 'absent'} does not exist")]:
        with pytest.raises(ValidationError, match=re.escape(says)):
            CtrDataSettings(data=path)
