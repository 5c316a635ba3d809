"""Multi-exponentiation prod_i c_i^(e_i) mod N^2 with Pippenger's bucket method.

Computing X^T [[d]] column by column as one exponentiation per entry costs about
(bits of e) squarings per entry. The bucket method instead splits every |e_i| into w-bit
digits and, per digit position, multiplies c_i into bucket[digit] (one multiplication per
non-zero digit), then combines the buckets with a running product, so the cost per entry is
about ceil(bits / w) multiplications plus a per-column overhead of ~2 * 2^w. Negative
exponents use a second set of buckets and a single modular inversion per column.

The window w is chosen per column by an explicit operation-count model, so dense high
precision columns, small integer columns and binary (subset-sum) columns all take the
cheapest plan. Exponents are int64 numpy arrays: compact to ship to worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gmpy2
import numpy as np
from gmpy2 import mpz

from core.paillier.errors import PaillierError, ShapeError

_MAX_WINDOW = 18
INVERSION_COST = 5
"""Approximate cost of one modular inversion in multiplications (measured with gmpy2)."""


@dataclass(frozen=True)
class ColumnPlan:
    """Chosen digit layout for one column: window width, digits and predicted cost."""

    rows: np.ndarray  # indices of the non-zero exponents
    digits: np.ndarray  # (windows, len(rows)) signed digits: sign of e times w-bit digit of |e|
    window: int
    multiplications: int


def plan_column(exponents: np.ndarray) -> ColumnPlan:
    """Pick the window width minimising the predicted number of multiplications."""
    rows = np.flatnonzero(exponents)
    values = exponents[rows]
    if rows.size == 0:
        return ColumnPlan(rows, np.zeros((0, 0), dtype=np.int64), 1, 0)
    magnitudes = np.abs(values)
    signs = np.sign(values)
    max_bits = int(magnitudes.max()).bit_length()
    best: ColumnPlan | None = None
    rises, previous = 0, None
    for window in _candidate_windows(max_bits, rows.size):
        digits = _digits(magnitudes, signs, window, max_bits)
        cost = _predicted_cost(digits, window)
        if best is None or cost < best.multiplications:
            best = ColumnPlan(rows, digits, window, cost)
        # The cost is close to unimodal in the window: stop after two consecutive rises.
        rises = rises + 1 if previous is not None and cost > previous else 0
        previous = cost
        if rises == 2:
            break
    assert best is not None
    return best


def _candidate_windows(max_bits: int, nonzero: int) -> list[int]:
    log_n = max(nonzero.bit_length() - 1, 1)
    high = min(max_bits, log_n + 2, _MAX_WINDOW)
    low = max(1, log_n - 6)
    candidates = set(range(low, high + 1)) if low <= high else set()
    candidates.add(min(max_bits, _MAX_WINDOW))
    return sorted(candidates)


def _digits(magnitudes: np.ndarray, signs: np.ndarray, window: int, max_bits: int) -> np.ndarray:
    windows = -(-max_bits // window)
    shifts = (np.arange(windows, dtype=np.int64) * window)[:, None]
    return ((magnitudes[None, :] >> shifts) & ((1 << window) - 1)) * signs[None, :]


def _aggregation_cost(occupied: np.ndarray) -> int:
    """Multiplications to turn buckets B_v (v ascending in ``occupied``) into prod B_v^v."""
    if occupied.size == 0:
        return 0
    gaps = np.diff(occupied, prepend=0)
    bits = np.floor(np.log2(gaps)).astype(np.int64)  # squarings of a binary powmod
    extra = np.bitwise_count(gaps.astype(np.uint64)).astype(np.int64) - 1
    return 2 * (occupied.size - 1) + int(bits.sum() + extra.sum())


def _predicted_cost(digits: np.ndarray, window: int) -> int:
    cost = 0
    has_negative = False
    nonempty_windows = 0
    for row in digits:
        positive = row[row > 0]
        negative = -row[row < 0]
        has_negative |= negative.size > 0
        nonempty_windows += bool(positive.size or negative.size)
        for part in (positive, negative):
            if part.size:
                occupied = np.flatnonzero(np.bincount(part))
                cost += part.size - occupied.size + _aggregation_cost(occupied)
    accumulators = 2 if has_negative else 1
    cost += accumulators * (digits.shape[0] - 1) * window + nonempty_windows
    return cost + (INVERSION_COST if has_negative else 0)


def execute_column(bases: Sequence[mpz], plan: ColumnPlan, modulus: mpz) -> mpz:
    """Evaluate prod_i bases[i]^e_i for the column described by ``plan``."""
    positive_total: mpz | None = None
    negative_total: mpz | None = None
    shift = 1 << plan.window
    row_ids = plan.rows.tolist()
    for digit_row in plan.digits[::-1]:
        if positive_total is not None:
            positive_total = gmpy2.powmod(positive_total, shift, modulus)
        if negative_total is not None:
            negative_total = gmpy2.powmod(negative_total, shift, modulus)
        positive_buckets: dict[int, mpz] = {}
        negative_buckets: dict[int, mpz] = {}
        for row, digit in zip(row_ids, digit_row.tolist(), strict=True):
            if digit == 0:
                continue
            buckets = positive_buckets if digit > 0 else negative_buckets
            key = digit if digit > 0 else -digit
            current = buckets.get(key)
            buckets[key] = bases[row] if current is None else current * bases[row] % modulus
        positive_total = _times(positive_total, _aggregate(positive_buckets, modulus), modulus)
        negative_total = _times(negative_total, _aggregate(negative_buckets, modulus), modulus)
    result = mpz(1) if positive_total is None else positive_total
    if negative_total is not None:
        result = result * _invert(negative_total, modulus) % modulus
    return result


def _times(accumulator: mpz | None, factor: mpz | None, modulus: mpz) -> mpz | None:
    if factor is None:
        return accumulator
    return factor if accumulator is None else accumulator * factor % modulus


def _aggregate(buckets: dict[int, mpz], modulus: mpz) -> mpz | None:
    """prod_v buckets[v]^v via a running product over the occupied values (descending)."""
    if not buckets:
        return None
    keys = sorted(buckets, reverse=True)
    running: mpz | None = None
    total: mpz | None = None
    for index, key in enumerate(keys):
        bucket = buckets[key]
        running = bucket if running is None else running * bucket % modulus
        gap = key - (keys[index + 1] if index + 1 < len(keys) else 0)
        term = running if gap == 1 else gmpy2.powmod(running, gap, modulus)
        total = term if total is None else total * term % modulus
    return total


def _invert(value: mpz, modulus: mpz) -> mpz:
    try:
        return gmpy2.invert(value, modulus)
    except ZeroDivisionError as exc:
        raise PaillierError("a ciphertext is not invertible modulo n^2 (malformed input)") from exc


def multiexp_columns(bases: Sequence[mpz], exponents: np.ndarray, modulus: mpz) -> list[mpz]:
    """For every column j of ``exponents`` (rows x cols), prod_i bases[i]^exponents[i, j]."""
    if exponents.ndim != 2 or exponents.shape[0] != len(bases):
        raise ShapeError(
            f"exponent matrix of shape {exponents.shape} does not match {len(bases)} bases"
        )
    return [
        execute_column(bases, plan_column(exponents[:, column]), modulus)
        for column in range(exponents.shape[1])
    ]


def predicted_multiplications(exponents: np.ndarray) -> int:
    """Operation count of :func:`multiexp_columns` for this exponent matrix (no big-int work)."""
    return sum(plan_column(exponents[:, j]).multiplications for j in range(exponents.shape[1]))
