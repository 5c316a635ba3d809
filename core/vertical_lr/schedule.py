"""The public training schedule every party derives from the same seed.

Rows are PSI-aligned, so a row index means the same person at every party. The hold-out
slice and the mini-batch order depend only on (row count, seed, epoch), never on data, so
parties agree on them without a message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.holdout import seeded_holdout_rows


@dataclass(frozen=True)
class Schedule:
    n_rows: int
    batch_size: int
    seed: int
    holdout_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.n_rows < 2:
            raise ValueError("need at least two aligned rows")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not 0 <= self.holdout_fraction < 0.5:
            raise ValueError("holdout_fraction must be in [0, 0.5)")

    def _split(self) -> tuple[np.ndarray, np.ndarray]:
        held_out = seeded_holdout_rows(self.n_rows, self.holdout_fraction, [self.seed, 0])
        return np.setdiff1d(np.arange(self.n_rows), held_out), held_out

    @property
    def train_rows(self) -> np.ndarray:
        return self._split()[0]

    @property
    def holdout_rows(self) -> np.ndarray:
        return self._split()[1]

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.train_rows) // self.batch_size)

    def batch(self, epoch: int, index: int) -> np.ndarray:
        """Row indices of mini-batch ``index`` of ``epoch``."""
        rows = self.train_rows
        order = np.random.default_rng([self.seed, 1, epoch]).permutation(len(rows))
        return np.sort(rows[order[index * self.batch_size : (index + 1) * self.batch_size]])

    def round_of(self, epoch: int, index: int) -> int:
        return epoch * self.batches_per_epoch + index

    def position(self, round_: int) -> tuple[int, int]:
        return divmod(round_, self.batches_per_epoch)
