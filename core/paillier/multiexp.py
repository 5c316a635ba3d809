"""Multi-exponentiation prod_i c_i^(e_i) mod N^2 with Pippenger's bucket method.

Computing X^T [[d]] column by column as one exponentiation per entry costs about
(bits of e) squarings per entry. The bucket method instead splits every exponent into w-bit
digits and, per digit position, puts c_i into bucket[digit], then combines the buckets with
a running product, so the cost per entry is about ceil(bits / w) multiplications plus a
per-column overhead of ~2^w. Costs are dominated by GMP's multiplications modulo N^2, so the
code keeps the Python work per multiplication to a minimum.

Dense columns (features: most entries non-zero) take the fused path: the column is made
non-negative by adding a bias ``b`` (``e + b >= 0``), each digit position sorts its rows by
digit once (numpy) and one running product over the sorted bases yields the buckets' weighted
product, and the bias is removed with ``(prod_i c_i)^-b``, where ``prod_i c_i`` and its one
inverse are shared by every column. Sparse, binary or extreme columns take a per-column plan
(window chosen by an explicit operation-count model, negative exponents in their own buckets).
Exponents are int64 numpy arrays: compact to ship to worker processes. The fused dense path
runs in C where the native kernel is built and faster for the modulus (:mod:`.native`: same
algorithm and windows, Montgomery arithmetic); otherwise, and as the reference, with gmpy2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gmpy2
import numpy as np
from gmpy2 import mpz

from core.paillier import native
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
    results: list[mpz | None] = [None] * exponents.shape[1]
    dense = [j for j in range(exponents.shape[1]) if _is_dense(exponents[:, j])]
    if dense:
        products = _dense_columns(bases, exponents[:, dense], modulus)
        for j, value in zip(dense, products, strict=True):
            results[j] = value
    for j, value in enumerate(results):
        if value is None:
            results[j] = execute_column(bases, plan_column(exponents[:, j]), modulus)
    return results  # type: ignore[return-value]


_DENSE_FRACTION = 0.5
_MAX_SPAN = 1 << 62  # e + bias must stay an int64


def _is_dense(column: np.ndarray) -> bool:
    """Feature-like: mostly non-zero, more than a few bits, and a span that fits int64."""
    if column.size < 2 or np.count_nonzero(column) < _DENSE_FRACTION * column.size:
        return False
    low, high = int(column.min()), int(column.max())
    return high - low < _MAX_SPAN and max(abs(low), abs(high)).bit_length() > 3


def dense_window(rows: int, bits: int) -> int:
    """Window minimising ceil(bits / w) * (rows + 2^w): one product per row and digit
    position, one per occupied bucket."""
    candidates = range(1, min(bits, _MAX_WINDOW) + 1)
    return min(candidates, key=lambda w: (-(-bits // w)) * (rows + (1 << w)))


def _dense_columns(bases: Sequence[mpz], exponents: np.ndarray, modulus: mpz) -> list[mpz]:
    lows = exponents.min(axis=0)
    biases = np.where(lows < 0, -lows, 0)
    shifted = exponents + biases  # >= 0 and < 2^62
    rows = len(bases)
    windows = [dense_window(rows, max(int(high).bit_length(), 1)) for high in shifted.max(axis=0)]
    product = None
    if native.preferred(modulus):
        # With biases, the product of the bases comes from the kernel as one more column (of
        # ones, window 1): it holds the bases in Montgomery form already, so that is one
        # product per row, against a gmpy2 product and division per row (measured: 30,000
        # bases at 4096 bits, 0.135 s CPU in gmpy2, about a third of the signed columns' cost
        # beyond the unsigned ones' in a chunk of four columns).
        if biases.any():
            shifted = np.column_stack([shifted, np.ones(rows, dtype=np.int64)])
            windows = [*windows, 1]
        results = native.dense_multiexp(
            bases, np.ascontiguousarray(shifted), np.array(windows, dtype=np.int64), modulus
        )
        if biases.any():
            product = results.pop()
    else:
        results = [
            _dense_column(bases, shifted[:, j], window, modulus) for j, window in enumerate(windows)
        ]
    if biases.any():
        inverse = _invert(product if product is not None else _product(bases, modulus), modulus)
        results = [
            r if b == 0 else r * gmpy2.powmod(inverse, int(b), modulus) % modulus
            for r, b in zip(results, biases.tolist(), strict=True)
        ]
    return results


def _dense_column(bases: Sequence[mpz], column: np.ndarray, window: int, modulus: mpz) -> mpz:
    """prod_i bases[i]^column[i] for a non-negative column, w-bit digits from the top (the
    reference the native kernel is tested against)."""
    bits = max(int(column.max()).bit_length(), 1)
    total: mpz | None = None
    for position in reversed(range(-(-bits // window))):
        if total is not None:
            total = gmpy2.powmod(total, 1 << window, modulus)
        digits = (column >> (position * window)) & ((1 << window) - 1)
        total = _times(total, _weighted_product(bases, digits, modulus), modulus)
    return mpz(1) if total is None else total


def _weighted_product(bases: Sequence[mpz], digits: np.ndarray, modulus: mpz) -> mpz | None:
    """prod_i bases[i]^digits[i] for small non-negative digits, in one pass.

    Rows sorted by digit, descending; ``running`` is the product of the bases whose digit is
    at least the current value v, and the total takes running^(v - next lower value): the
    bucket method's accumulation and aggregation fused into one loop over the bases.
    """
    order = np.argsort(-digits, kind="stable")
    sorted_digits = digits[order]
    nonzero = int(np.count_nonzero(sorted_digits))
    if nonzero == 0:
        return None
    order, sorted_digits = order[:nonzero], sorted_digits[:nonzero]
    starts = np.flatnonzero(np.diff(sorted_digits, prepend=sorted_digits[0] + 1)).tolist()
    values = sorted_digits[starts].tolist()
    ends = [*starts[1:], nonzero]
    ordered = [bases[i] for i in order.tolist()]
    running = ordered[0]
    first = 1
    total: mpz | None = None
    for index, (end, value) in enumerate(zip(ends, values, strict=True)):
        for base in ordered[first:end]:
            running = running * base % modulus
        first = end
        gap = value - (values[index + 1] if index + 1 < len(values) else 0)
        term = running if gap == 1 else gmpy2.powmod(running, gap, modulus)
        total = term if total is None else total * term % modulus
    return total


def _product(bases: Sequence[mpz], modulus: mpz) -> mpz:
    result = mpz(1)
    for base in bases:
        result = result * base % modulus
    return result


def predicted_multiplications(exponents: np.ndarray) -> int:
    """Operation count of :func:`multiexp_columns` for this exponent matrix (no big-int work)."""
    return sum(plan_column(exponents[:, j]).multiplications for j in range(exponents.shape[1]))
