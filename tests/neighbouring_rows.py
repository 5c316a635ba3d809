"""Neighbouring inputs for sensitivity tests: one party's rows with one row replaced.

Shared by the row-level release tests (one round and two), which check that no replacement,
planted worst case or random, moves a release further than its bound.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from core.sparse_lda import PartyData

ReplacedRow = tuple[np.ndarray, int, np.ndarray, int]
"""(old row, old label, new row, new label)"""


def party(features: np.ndarray, labels: np.ndarray, name: str = "p") -> PartyData:
    """A party whose columns are named x0, x1, ..."""
    return PartyData(name, features, labels, tuple(f"x{j}" for j in range(features.shape[1])))


def neighbouring_parties(
    rng: np.random.Generator,
    n_rows: int,
    n_features: int,
    worst_cases: Sequence[ReplacedRow],
    trials: int,
) -> Iterator[tuple[int, PartyData, PartyData]]:
    """``(trial, before, after)`` pairs that differ in one row, label included.

    The first trials plant each worst case at a random row; the rest replace a random row by
    a random one of scale 0.5, 3 or 30 (inside and far outside any clip ball) and label.
    """
    for trial in range(trials):
        features = rng.normal(scale=1.5, size=(n_rows, n_features))
        labels = np.repeat([0, 1], [n_rows // 2, n_rows - n_rows // 2])
        row = int(rng.integers(n_rows))
        if trial < len(worst_cases):
            old, old_label, new, new_label = worst_cases[trial]
            features[row], labels[row] = old, old_label
        else:
            new = rng.normal(scale=rng.choice([0.5, 3.0, 30.0]), size=n_features)
            new_label = int(rng.integers(2))
        after_features, after_labels = features.copy(), labels.copy()
        after_features[row], after_labels[row] = new, new_label
        yield trial, party(features, labels), party(after_features, after_labels)
