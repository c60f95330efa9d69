"""What a CTR user reads of a model: ROC AUC and logloss on held-out samples."""
from __future__ import annotations

import numpy as np

EPS = 1e-7


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The probability that a random positive scores above a random negative (ties count half):
    the Mann-Whitney statistic over average ranks. NaN when one class is missing."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.arange(1, scores.size + 1)
    # Tied scores share the average of their ranks.
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    average = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(average, ends - starts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def expected_auc(p: np.ndarray) -> float:
    """The AUC that labels drawn as Bernoulli(p) would give ``p`` itself, on average: how well the
    best possible model can do on these samples, without the noise of one draw of labels."""
    p = np.sort(np.asarray(p, dtype=np.float64))
    below = np.cumsum(1.0 - p) - (1.0 - p)           # negatives' weight strictly below each sample
    pairs = p.sum() * (1.0 - p).sum() - (p * (1.0 - p)).sum()
    return float((p * below).sum() / pairs) if pairs > 0 else float("nan")


def logloss(p: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(np.asarray(p, dtype=np.float64), EPS, 1.0 - EPS)
    y = np.asarray(labels, dtype=np.float64)
    return float(-(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)).mean())
