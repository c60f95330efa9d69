"""A corpus folder on disk: its splits, their words, and the checks a ``--data`` folder must pass
at start. No torch: settings validate with it."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

EOS = "<eos>"
_SPLIT_FILES = {
    "train": ("train.txt", "wiki.train.tokens"),
    "valid": ("valid.txt", "wiki.valid.tokens"),
    "test": ("test.txt", "wiki.test.tokens"),
}


def find_splits(folder: Path) -> dict[str, Path]:
    if not folder.exists():
        raise FileNotFoundError(f"data folder {folder} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not a folder: give the folder that holds train.txt, "
                                 "valid.txt and test.txt")
    found = {}
    for split, names in _SPLIT_FILES.items():
        for n in names:
            if (folder / n).is_file():
                found[split] = folder / n
                break
    if not found:
        raise FileNotFoundError(f"no train/valid/test text in {folder} (expected e.g. train.txt or wiki.train.tokens)")
    return found


def roles(splits: dict[str, Path]) -> tuple[str, Optional[str]]:
    """(the split trained on, the split held out or None)."""
    if "train" in splits:
        return "train", ("valid" if "valid" in splits else "test" if "test" in splits else None)
    # WikiText-2 as shipped here has no train split: train on valid, hold out test.
    train = "valid" if "valid" in splits else "test"
    return train, ("test" if train == "valid" and "test" in splits else None)


def check_folder(folder: Path) -> Path:
    """``folder`` if it holds a usable corpus, else ``ValueError`` naming the path and what is wrong
    (so a bad ``--data`` is a sentence at start, not a traceback mid-training)."""
    try:
        splits = find_splits(folder)
    except OSError as exc:
        raise ValueError(str(exc)) from None
    for path in splits.values():
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{path} cannot be read: {exc.strerror}") from None
        if b"\0" in raw[:65536]:
            raise ValueError(f"{path} is binary, not text")
        try:
            text = raw.decode("utf8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
        if not text.strip():
            raise ValueError(f"{path} is empty")
    return folder


def training_tokens(folder: Path) -> int:
    """Tokens of the split ``Corpus.load`` trains on."""
    splits = find_splits(folder)
    return sum(1 for _ in words(splits[roles(splits)[0]]))


def check_size(folder: Path, trainers: int, batch_size: int) -> None:
    """``ValueError`` if ``folder``'s training text is too small to give every trainer two rows."""
    tokens = training_tokens(folder)
    if tokens // trainers // batch_size < 2:
        raise ValueError(f"{folder}'s training text has {tokens} tokens, too few for {trainers} trainer(s) of batch "
                         f"size {batch_size} (at least {2 * batch_size * trainers}): give more text, or fewer trainers "
                         f"or a smaller --batch-size")


def words(path: Path) -> Iterator[str]:
    with open(path, encoding="utf8") as f:
        for line in f:
            yield from line.split()
            yield EOS
