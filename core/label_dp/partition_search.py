"""Exact search for the best split of sorted labels into RR-on-Bins bins.

The expected loss of RR-on-Bins with bins ``I_1 .. I_m`` is ``sum_j cost(I_j) / (E - 1 + m)``:
a ratio whose denominator depends only on the number of bins. The paper's dynamic program
keeps the number of bins as a second state: O(k^2) states with O(k) choices each. Here the
ratio is removed with Dinkelbach's parametric method instead: for a trial value ``lam`` the
problem ``min_P sum_j (cost(I_j) - lam)`` is a one-dimensional DP over the last bin boundary,
O(k^2) and vectorised per row; setting ``lam`` to the ratio of the partition it returns and
repeating strictly decreases ``lam`` until the DP cannot beat it, which certifies the global
optimum (the set of partitions is finite, so it terminates; in practice after 3-6 rounds).

No quadrangle inequality is assumed: with the prior's global term the bin cost is not Monge in
general (the bin value is pulled towards the global centre, so the cross derivative of the
cost changes sign; on random priors about 5% of index quadruples violate it), so Knuth or
divide-and-conquer pruning could lose the optimum. Each DP round here is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.label_dp.bin_costs import BinCosts

_ROW_CACHE_LIMIT = 4_000_000  # float64 entries kept between rounds (32 MB)
_BLOCK_ENTRIES = 1_000_000  # bins costed per numpy call when filling that cache
_RELATIVE_PROGRESS = 1e-13
_COARSE_CUTS = 256  # boundaries of the warm-start problem for large k


@dataclass(frozen=True)
class Partition:
    """Bins as exclusive end positions (``ends[-1] == k``) and the summed bin cost."""

    ends: tuple[int, ...]
    total_cost: float

    @property
    def bin_count(self) -> int:
        return len(self.ends)

    def ratio(self, extra_weight: float) -> float:
        """Expected loss of RR-on-Bins with these bins: cost / (E - 1 + m)."""
        return self.total_cost / (extra_weight + self.bin_count)

    def bounds(self) -> list[tuple[int, int]]:
        """Inclusive ``(start, end)`` label positions of every bin, in order."""
        starts = (0, *self.ends[:-1])
        return [(start, end - 1) for start, end in zip(starts, self.ends, strict=True)]


class _Rows:
    """Costs of all bins between allowed boundaries, by last boundary.

    When the triangle of costs fits in memory it is computed once, in rectangular blocks (a
    few large numpy calls instead of one small call per row) and reused by every round;
    otherwise each round recomputes one row at a time.
    """

    def __init__(self, costs: BinCosts, cuts: np.ndarray) -> None:
        self._costs = costs
        self.cuts = cuts
        count = len(cuts)
        self._cache = self._all_rows() if count * (count - 1) // 2 <= _ROW_CACHE_LIMIT else None

    def _all_rows(self) -> list[np.ndarray]:
        cuts = self.cuts
        block = max(1, _BLOCK_ENTRIES // len(cuts))
        rows: list[np.ndarray] = []
        for first in range(1, len(cuts), block):
            indices = np.arange(first, min(first + block, len(cuts)))
            ends = (cuts[indices] - 1)[:, None]
            # Entries with start > end are not bins; clamp them to a valid bin and drop them.
            starts = np.minimum(cuts[None, : indices[-1]], ends)
            costs = self._costs.costs(starts, ends)
            rows.extend(costs[row, :index].copy() for row, index in enumerate(indices))
        return rows

    def row(self, index: int) -> np.ndarray:
        """Costs of the bins ``[cuts[j], cuts[index] - 1]`` for ``j < index``."""
        if self._cache is not None:
            return self._cache[index - 1]
        return self._costs.costs(self.cuts[:index], int(self.cuts[index]) - 1)


def _cost_of(costs: BinCosts, ends: tuple[int, ...]) -> Partition:
    """The partition with its summed bin cost, recomputed bin by bin (no DP round-off)."""
    last = np.asarray(ends, dtype=np.int64) - 1
    starts = np.concatenate(([0], last[:-1] + 1))
    return Partition(ends, float(np.sum(costs.costs(starts, last))))


def _best_penalised(rows: _Rows, penalty: float) -> tuple[int, ...]:
    """Partition minimising ``sum_j (cost(I_j) - penalty)``: one O(cuts^2) DP round."""
    count = len(rows.cuts)
    best = np.empty(count)
    best[0] = 0.0
    previous = np.zeros(count, dtype=np.int64)
    for index in range(1, count):
        candidates = best[:index] + rows.row(index)
        choice = int(np.argmin(candidates))
        best[index] = candidates[choice] - penalty
        previous[index] = choice
    ends: list[int] = []
    index = count - 1
    while index > 0:
        ends.append(int(rows.cuts[index]))
        index = int(previous[index])
    return tuple(reversed(ends))


def _dinkelbach(
    costs: BinCosts, cuts: np.ndarray, start: Partition, extra_weight: float
) -> Partition:
    """Best partition with boundaries in ``cuts``, improving on ``start`` until certified."""
    rows = _Rows(costs, cuts)
    best = start
    for _ in range(len(cuts) + 1):  # never exhausted: each round strictly improves
        penalty = best.ratio(extra_weight)
        challenger = _cost_of(costs, _best_penalised(rows, penalty))
        improvement = penalty - challenger.ratio(extra_weight)
        if improvement <= _RELATIVE_PROGRESS * max(abs(penalty), 1e-300):
            break
        best = challenger
    return best


def _near(ends: tuple[int, ...], radius: int, size: int) -> np.ndarray:
    """All boundary positions within ``radius`` of the given bin ends (plus 0 and ``size``)."""
    offsets = np.arange(-radius, radius + 1)
    inner = np.asarray(ends[:-1], dtype=np.int64)[:, None] + offsets[None, :]
    return np.unique(np.clip(np.concatenate(([0, size], inner.ravel())), 0, size))


def optimal_partition(costs: BinCosts, extra_weight: float) -> Partition:
    """The partition of all ``costs.size`` labels minimising the RR-on-Bins expected loss.

    For large k two cheap warm starts come first, both exact on restricted boundary sets:
    boundaries on a coarse uniform set, then boundaries within one coarse step of those found.
    The last usually is the optimum already, so typically a single full O(k^2) round is left,
    and it is the one that certifies optimality.
    """
    size = costs.size
    candidates = [_cost_of(costs, (size,)), _cost_of(costs, tuple(range(1, size + 1)))]
    best = min(candidates, key=lambda partition: partition.ratio(extra_weight))
    if size > 2 * _COARSE_CUTS:
        coarse = np.unique(np.linspace(0, size, _COARSE_CUTS + 1).round().astype(np.int64))
        best = _dinkelbach(costs, coarse, best, extra_weight)
        near = _near(best.ends, -(-size // _COARSE_CUTS), size)
        if len(near) <= size // 2:
            best = _dinkelbach(costs, near, best, extra_weight)
    return _dinkelbach(costs, np.arange(size + 1), best, extra_weight)
