import pytest
import torch

from tests.support.cluster import WIKITEXT
from trainer.lm.data import BatchStream, Corpus, batchify, build_vocab, share, synthetic_text
from trainer.lm.text import EOS


def test_synthetic_text_is_seeded_and_learnable():
    a, b = synthetic_text(5000, seed=3), synthetic_text(5000, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, synthetic_text(5000, seed=4))
    # Each word has few successors: far below the uniform log(vocab) entropy.
    pairs = set(zip(a[:-1].tolist(), a[1:].tolist()))
    assert len(pairs) < 5 * len(set(a.tolist()))


def test_shares_are_disjoint_and_batches_contiguous():
    text = torch.arange(100)
    parts = [share(text, i, 3) for i in range(3)]
    assert sum(p.numel() for p in parts) == 99 and not set(parts[0].tolist()) & set(parts[1].tolist())
    data = batchify(torch.arange(40), 4)          # [10, 4], column j = 10j..10j+9
    assert data[:, 1].tolist() == list(range(10, 20))
    stream = BatchStream(data, bptt=4)
    x, y, wrapped = stream.next()
    assert x.shape == (4, 4) and torch.equal(y, data[1:5]) and not wrapped


def test_folder_layout_and_splits(tmp_path):
    (tmp_path / "train.txt").write_text("a b c\nc b\n")
    (tmp_path / "valid.txt").write_text("a d\n")
    c = Corpus.load(tmp_path)
    assert c.ntoken == len(build_vocab(tmp_path)) == 5  # a b c <eos> d
    assert c.train.numel() == 7 and c.heldout.numel() == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no train/valid/test"):
        Corpus.load(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Corpus.load(tmp_path / "absent")


@pytest.mark.skipif(not WIKITEXT.is_dir(), reason="shared WikiText-2 not present")
def test_wikitext2_without_train_split_trains_on_valid_and_holds_out_test():
    c = Corpus.load(WIKITEXT)
    assert c.heldout is not None and c.train.numel() > 200_000 and c.heldout.numel() > 200_000
    assert c.ntoken == len(build_vocab(WIKITEXT)) and EOS in build_vocab(WIKITEXT).word_to_id
