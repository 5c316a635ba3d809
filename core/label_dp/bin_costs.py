"""Cost of one RR-on-Bins bin, for every bin ending at a given label, from prefix sums.

With ``E = e^eps`` and ``c = E - 1``, a bin ``I`` (a run of consecutive sorted labels) that
outputs ``v`` contributes ``sum_t p_t loss(v, y_t) + c * sum_{t in I} p_t loss(v, y_t)`` to
``(E + m - 1)`` times the expected loss: every label reaches every bin with weight 1 and its
own bin with the extra weight ``c``. Each class below minimises that over ``v`` in closed form
(weighted mean for squared and Poisson loss, weighted median for absolute loss) using prefix
sums, so all bins ending at one label cost O(k) numpy work (a merge of sorted runs for the
median).

Labels are passed sorted and strictly increasing with positive, normalised weights.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from scipy.special import xlogy

from core.label_dp.losses import LossName


class BinCosts(Protocol):
    """Closed-form bin costs and bin values for one loss, prior and epsilon."""

    size: int

    def costs(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        """Costs of the bins ``[starts, ends]`` (inclusive positions, broadcast together)."""
        ...

    def best_values(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        """The output values minimising the cost of the bins ``[starts, ends]``."""
        ...


def _prefix(values: np.ndarray) -> np.ndarray:
    """Prefix sums with a leading zero, so ``sum(values[a:b]) == p[b] - p[a]``."""
    return np.concatenate(([0.0], np.cumsum(values)))


class SquaredBinCosts:
    """Squared loss; labels are centred on the prior mean so the sums stay small.

    Minimising ``sum_t w_t (v - y_t)^2`` with ``w_t = p_t (1 + c [t in I])`` gives
    ``v = c S_I / (1 + c W_I)`` (centred) and the cost
    ``Q + c Q_I - (c S_I)^2 / (1 + c W_I)``, where ``W, S, Q`` sum ``p, p y, p y^2``.
    """

    def __init__(self, labels: np.ndarray, weights: np.ndarray, extra_weight: float) -> None:
        self.size = len(labels)
        self._centre = float(np.dot(weights, labels))
        centred = labels - self._centre
        c = extra_weight
        self._scaled_w = c * _prefix(weights)
        self._scaled_s = c * _prefix(weights * centred)
        self._scaled_q = c * _prefix(weights * centred**2)
        self._total = float(np.dot(weights, centred**2))

    def costs(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        weight = (1.0 + self._scaled_w[ends + 1]) - self._scaled_w[starts]
        pull = self._scaled_s[ends + 1] - self._scaled_s[starts]
        spread = self._scaled_q[ends + 1] - self._scaled_q[starts]
        np.square(pull, out=pull)
        np.divide(pull, weight, out=pull)
        np.subtract(spread, pull, out=spread)
        return np.add(spread, self._total, out=spread)

    def best_values(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        weight = (1.0 + self._scaled_w[ends + 1]) - self._scaled_w[starts]
        pull = self._scaled_s[ends + 1] - self._scaled_s[starts]
        return self._centre + pull / weight


class PoissonBinCosts:
    """Poisson unit deviance; the minimiser is again the weighted mean.

    At ``v = S_w / W_w`` the cost ``sum_t w_t (v - y_t + y_t log y_t - y_t log v)`` reduces to
    ``sum_t w_t y_t log y_t - S_w log(S_w / W_w)``.
    """

    def __init__(self, labels: np.ndarray, weights: np.ndarray, extra_weight: float) -> None:
        self.size = len(labels)
        c = extra_weight
        self._scaled_w = c * _prefix(weights)
        self._scaled_s = c * _prefix(weights * labels)
        self._scaled_ylogy = c * _prefix(weights * xlogy(labels, labels))
        self._total_s = float(np.dot(weights, labels))
        self._total_ylogy = float(np.dot(weights, xlogy(labels, labels)))

    def costs(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        weight = (1.0 + self._scaled_w[ends + 1]) - self._scaled_w[starts]
        mass = (self._total_s + self._scaled_s[ends + 1]) - self._scaled_s[starts]
        ylogy = (self._total_ylogy + self._scaled_ylogy[ends + 1]) - self._scaled_ylogy[starts]
        np.divide(mass, weight, out=weight)
        return np.subtract(ylogy, xlogy(mass, weight, out=weight), out=ylogy)

    def best_values(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        weight = (1.0 + self._scaled_w[ends + 1]) - self._scaled_w[starts]
        mass = (self._total_s + self._scaled_s[ends + 1]) - self._scaled_s[starts]
        return mass / weight


class AbsoluteBinCosts:
    """Absolute loss; the minimiser is a weighted median of the bin-weighted labels.

    The cumulative bin weight up to label ``r`` is piecewise in ``r`` (before, inside and after
    the bin), and in each piece an affine function of the plain prefix weight, so one search
    of the prefix weights finds the median once its piece is known.
    """

    def __init__(self, labels: np.ndarray, weights: np.ndarray, extra_weight: float) -> None:
        self.size = len(labels)
        self._centre = float(np.dot(weights, labels))
        self._labels = labels - self._centre
        self._c = extra_weight
        self._w = _prefix(weights)
        self._s = _prefix(weights * self._labels)
        self._upto = self._w[1:]  # weight of labels 0..r, for r = 0..k-1

    def _count_below(self, thresholds: np.ndarray) -> np.ndarray:
        """For each threshold, how many prefix weights are strictly smaller.

        Ascending thresholds (the usual case: every piece of a row is monotone) are merged
        with the prefix weights by a stable sort of two sorted runs, which is linear and
        several times faster than one binary search per threshold.
        """
        if thresholds.size < 2 or np.any(thresholds[1:] < thresholds[:-1]):
            return np.searchsorted(self._upto, thresholds, side="left")
        merged = np.concatenate((thresholds, self._upto))  # ties: thresholds sort first
        order = np.argsort(merged, kind="stable")
        return np.flatnonzero(order < thresholds.size) - np.arange(thresholds.size)

    def _median_index(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        """First label whose cumulative bin weight reaches half of the bin's total weight.

        The piece is decided from the weights at the bin's edges. For the bins ending at one
        label (``starts`` ascending) the median is inside the bin for a prefix of ``starts``
        and before it or after it for the rest, and each piece's thresholds are monotone.
        """
        c, w = self._c, self._w
        starts, ends = np.broadcast_arrays(starts, ends)
        w_in = w[ends + 1] - w[starts]
        half = (1.0 + c * w_in) / 2.0
        median = np.empty(starts.shape, dtype=np.int64)
        before = w[starts] >= half
        after = ~before & (w[ends + 1] + c * w_in < half)
        inside = ~(before | after)
        if before.any():
            found = self._count_below(half[before][::-1])[::-1]
            median[before] = np.minimum(found, starts[before] - 1)
        if after.any():
            found = self._count_below(((1.0 - c * w_in) / 2.0)[after])
            median[after] = np.clip(found, ends[after] + 1, self.size - 1)
        if inside.any():
            lifted = (1.0 + c * w[ends + 1]) + c * w[starts]
            found = self._count_below(lifted[inside] / (2.0 * (1.0 + c)))
            median[inside] = np.clip(found, starts[inside], ends[inside])
        return median

    def costs(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        c, w, s = self._c, self._w, self._s
        median = self._median_index(starts, ends)
        value = self._labels[median]
        overlaps = median >= starts
        overlap_end = np.minimum(median, ends) + 1
        w_left = w[median + 1] + c * np.where(overlaps, w[overlap_end] - w[starts], 0.0)
        s_left = s[median + 1] + c * np.where(overlaps, s[overlap_end] - s[starts], 0.0)
        w_all = 1.0 + c * (w[ends + 1] - w[starts])
        s_all = s[-1] + c * (s[ends + 1] - s[starts])
        # Weighted sum of |v - y|: labels up to the median lie below v, the rest above.
        return value * (2.0 * w_left - w_all) + s_all - 2.0 * s_left

    def best_values(self, starts: np.ndarray, ends: np.ndarray | int) -> np.ndarray:
        return self._labels[self._median_index(starts, ends)] + self._centre


def bin_costs_for(
    loss: LossName, labels: np.ndarray, weights: np.ndarray, extra_weight: float
) -> BinCosts:
    """The bin-cost engine for ``loss``."""
    engines = {
        "squared": SquaredBinCosts,
        "absolute": AbsoluteBinCosts,
        "poisson": PoissonBinCosts,
    }
    return engines[loss](labels, weights, extra_weight)
