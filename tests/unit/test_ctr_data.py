"""CTR data: the generator's determinism and distribution, the Criteo reader's every failure, and
the quality measures against brute force."""
from __future__ import annotations

import gzip
import itertools

import numpy as np
import pytest

from trainer.ctr.criteo import CriteoError, CriteoStream, check, write
from trainer.ctr.quality import auc, expected_auc, logloss
from trainer.ctr.synthetic import CALIBRATED_FROM, KAGGLE_CARDINALITIES, TEST_OFFSET, SyntheticCtr

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
    (GOOD.replace("68fd1e64", "68fd1e6z", 1) + "\n", ":1: categorical C1 (field 15) is not hexadecimal: '68fd1e6z'"),
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
