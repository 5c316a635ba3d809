"""The public grid of label values that every mechanism works on.

The grid must be fixed *before* looking at the labels: taking the distinct observed values
would reveal which labels occur, outside any privacy budget. So it is built from a declared
range only. Default: every integer of the range when labels are declared integer and there
are at most ``max_size`` of them; otherwise ``max_size`` evenly spaced points (1,000 by
default: fine enough that snapping costs at most half a step, small enough that RR-on-Bins
is optimised in well under a second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.label_dp.errors import InvalidLabelError, InvalidPriorError
from core.option_defaults import DEFAULT_GRID_SIZE

MAX_GRID_SIZE = 10_000


@dataclass(frozen=True, eq=False)
class LabelGrid:
    """Sorted grid points covering the declared label range ``[low, high]``."""

    points: np.ndarray

    @property
    def low(self) -> float:
        return float(self.points[0])

    @property
    def high(self) -> float:
        return float(self.points[-1])

    @property
    def size(self) -> int:
        return len(self.points)

    def snap(self, labels: object, *, clip: bool = True) -> np.ndarray:
        """Each label replaced by the nearest grid point.

        With ``clip`` (the default) labels outside the range are first clipped to it, which is
        a per-record transformation and costs no privacy; without it they raise.
        """
        return self.points[self.positions(labels, clip=clip)]

    def positions(self, labels: object, *, clip: bool = True) -> np.ndarray:
        """Index of the nearest grid point for each label (see ``snap``)."""
        array = _checked_labels(labels)
        if not clip:
            outside = (array < self.low) | (array > self.high)
            if np.any(outside):
                bad = int(np.flatnonzero(outside)[0])
                raise InvalidLabelError(
                    f"labels[{bad}] = {array[bad]} is outside the declared range "
                    f"[{self.low}, {self.high}] ({int(outside.sum())} labels in total)"
                )
        array = np.clip(array, self.low, self.high)
        right = np.clip(np.searchsorted(self.points, array), 1, max(self.size - 1, 1))
        left = right - 1
        if self.size == 1:
            return np.zeros(len(array), dtype=np.int64)
        nearer_left = array - self.points[left] <= self.points[right] - array
        return np.where(nearer_left, left, right).astype(np.int64)

    def counts(self, labels: object, *, clip: bool = True) -> np.ndarray:
        """Histogram of the snapped labels over the grid points."""
        return np.bincount(self.positions(labels, clip=clip), minlength=self.size)


def _checked_labels(labels: object) -> np.ndarray:
    array = np.asarray(labels, dtype=np.float64)
    if array.ndim != 1:
        raise InvalidLabelError(f"labels must be 1-D; got shape {array.shape}")
    if array.size == 0:
        raise InvalidLabelError("labels are empty")
    if np.any(np.isnan(array)):
        bad = int(np.flatnonzero(np.isnan(array))[0])
        raise InvalidLabelError(f"labels[{bad}] is NaN")
    return array


def label_grid(
    low: float, high: float, *, integer: bool = False, max_size: int = DEFAULT_GRID_SIZE
) -> LabelGrid:
    """The default grid for labels declared to lie in ``[low, high]`` (see module docstring)."""
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise InvalidPriorError(f"label range must be finite with low <= high; got [{low}, {high}]")
    if not 1 <= max_size <= MAX_GRID_SIZE:
        raise InvalidPriorError(f"max_size must be in [1, {MAX_GRID_SIZE}]; got {max_size}")
    if integer:
        first, last = math.ceil(low), math.floor(high)
        if first > last:
            raise InvalidPriorError(f"no integer lies in the declared range [{low}, {high}]")
        if last - first + 1 <= max_size:
            return LabelGrid(np.arange(first, last + 1, dtype=np.float64))
    if low == high or max_size == 1:
        return LabelGrid(np.array([low if low == high else (low + high) / 2.0]))
    return LabelGrid(np.linspace(low, high, max_size))
