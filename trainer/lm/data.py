"""Corpus loading: WikiText-style folders or a built-in seeded synthetic text; pure, no RPC.

Tokenisation is the classic one: split each line on whitespace and append ``<eos>``. The vocabulary
covers every split present, in file order, so every trainer (and the servers sizing their tables)
derives the same ids from the same folder.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from trainer.lm.text import find_splits, roles, words

log = logging.getLogger(__name__)

SYNTHETIC_VOCAB = 1000


class Vocabulary:
    def __init__(self) -> None:
        self.word_to_id: dict[str, int] = {}

    def add(self, word: str) -> int:
        i = self.word_to_id.get(word)
        if i is None:
            i = self.word_to_id[word] = len(self.word_to_id)
        return i

    def __len__(self) -> int:
        return len(self.word_to_id)


def build_vocab(folder: Optional[Path]) -> Vocabulary:
    vocab = Vocabulary()
    if folder is None:
        for i in range(SYNTHETIC_VOCAB):
            vocab.add(f"w{i}")
        return vocab
    for path in find_splits(folder).values():
        for w in words(path):
            vocab.add(w)
    return vocab


def vocab_size(folder: Optional[Path]) -> int:
    return len(build_vocab(folder))


def synthetic_text(num_tokens: int, seed: int, vocab: int = SYNTHETIC_VOCAB) -> torch.Tensor:
    """A seeded Markov chain with a few likely successors per word: learnable, so the loss falls well
    below log(vocab), and deterministic, so every trainer sees the same text."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g).tolist()
    choice = torch.multinomial(torch.tensor([0.6, 0.25, 0.1, 0.05]), num_tokens, replacement=True, generator=g).tolist()
    out, word = [], 0
    for c in choice:
        word = successors[word][c]
        out.append(word)
    return torch.tensor(out, dtype=torch.long)


@dataclass
class Corpus:
    ntoken: int
    train: torch.Tensor                 # [tokens] ids
    heldout: Optional[torch.Tensor]     # [tokens] ids, or None
    description: str

    @staticmethod
    def load(folder: Optional[Path], *, synthetic_tokens: int = 200_000, seed: int = 1111) -> "Corpus":
        if folder is None:
            text = synthetic_text(synthetic_tokens + synthetic_tokens // 10, seed)
            return Corpus(SYNTHETIC_VOCAB, text[:synthetic_tokens], text[synthetic_tokens:],
                          f"synthetic corpus ({synthetic_tokens} tokens, seed {seed})")
        splits = find_splits(folder)
        vocab = build_vocab(folder)

        def ids(split: str) -> torch.Tensor:
            return torch.tensor([vocab.word_to_id[w] for w in words(splits[split])], dtype=torch.long)

        train_split, held = roles(splits)
        if train_split != "train":
            log.warning("%s has no train split: training on %s, evaluating on %s", folder, train_split, held)
        heldout = ids(held) if held else None
        train = ids(train_split)
        return Corpus(len(vocab), train, heldout,
                      f"{folder} (train: {train_split} {train.numel()} tokens, held out: {held}, vocab {len(vocab)})")


def share(tokens: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """The ``index``-th of ``count`` disjoint contiguous parts."""
    per = tokens.numel() // count
    return tokens[index * per:(index + 1) * per]


def trainer_share(corpus: Corpus, index: int, count: int, batch_size: int, eval_tokens: Optional[int],
                  eval_batch_size: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Trainer ``index`` of ``count``'s training share, batchified, and its held-out share (of the
    cluster's ``eval_tokens`` at most), or None when the corpus holds nothing out."""
    train = batchify(share(corpus.train, index, count), batch_size)
    if corpus.heldout is None:
        return train, None
    heldout = share(corpus.heldout, index, count)
    if eval_tokens is not None:
        heldout = heldout[: max(eval_tokens // count, eval_batch_size * 2)]
    return train, heldout


def batchify(tokens: torch.Tensor, batch_size: int) -> torch.Tensor:
    """[tokens] -> [rows, batch_size], each column a contiguous stream (the classic layout)."""
    rows = tokens.numel() // batch_size
    if rows < 2:
        raise ValueError(f"{tokens.numel()} tokens are too few for batch size {batch_size}")
    return tokens[: rows * batch_size].view(batch_size, rows).t().contiguous()


class BatchStream:
    """Consecutive (input, target) windows of ``bptt`` rows, wrapping to the start at the end."""

    def __init__(self, data: torch.Tensor, bptt: int) -> None:
        self.data, self.bptt = data, bptt
        self.position = 0
        self.epoch = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(input [bptt', batch], target [bptt', batch], wrapped)"""
        wrapped = False
        if self.position >= self.data.size(0) - 1:
            self.position, wrapped = 0, True
            self.epoch += 1
        n = min(self.bptt, self.data.size(0) - 1 - self.position)
        x = self.data[self.position:self.position + n]
        y = self.data[self.position + 1:self.position + 1 + n]
        self.position += n
        return x, y, wrapped
