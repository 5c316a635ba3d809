"""The one rule for which rows a job holds out to score its model.

Every party of a job must hold out the same rows without exchanging a message (rows are
PSI-aligned in the vertical flows, so an index means the same person everywhere) and no data
may shape the choice. The held-out rows are therefore a seeded permutation's first slice,
seeded by a public value the parties agree on (a job's seed or id).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["seeded_holdout_rows"]


def seeded_holdout_rows(
    rows: int, fraction: float, seed: int | Sequence[int], keep_for_training: int = 0
) -> np.ndarray:
    """Sorted indices of the ``round(rows * fraction)`` held-out rows, leaving at least
    ``keep_for_training`` rows to train on (fewer held out if need be)."""
    count = min(round(rows * fraction), max(rows - keep_for_training, 0))
    return np.sort(np.random.default_rng(seed).permutation(rows)[:count])
