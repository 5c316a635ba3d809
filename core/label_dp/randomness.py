"""Uniform random words and the two exact discrete draws the mechanisms need.

Privacy rests on the released distribution, so by default the words come from the operating
system's CSPRNG (``secrets``); a numpy ``Generator`` may be passed instead for reproducible
tests and benchmarks, and goes through exactly the same arithmetic. All draws work on
unsigned 64-bit integers, never on floating-point uniforms, so the realised probabilities are
known exactly (multiples of ``2**-64``) and rounding can be directed to keep the DP bound.
"""

from __future__ import annotations

import secrets
from fractions import Fraction

import numpy as np

RandomSource = np.random.Generator | None
_WORD_BITS = 64
_WORD_SPAN = 1 << _WORD_BITS


def random_words(size: int, rng: RandomSource = None) -> np.ndarray:
    """``size`` independent uniform uint64 words (CSPRNG unless ``rng`` is given)."""
    if rng is None:
        return np.frombuffer(secrets.token_bytes(8 * size), dtype="<u8").astype(np.uint64)
    if isinstance(rng, np.random.Generator):
        return rng.integers(0, _WORD_SPAN, size=size, dtype=np.uint64)
    raise TypeError(f"rng must be None (CSPRNG) or a numpy Generator; got {type(rng).__name__}")


def bernoulli_at_most(probability: float, size: int, rng: RandomSource = None) -> np.ndarray:
    """Booleans that are True with probability ``floor(probability * 2**64) / 2**64``.

    The realised probability never exceeds ``probability`` (and is below it by < 2**-64),
    which is the safe direction when ``probability`` is the 'keep the true value' chance.
    """
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"probability must be in [0, 1]; got {probability}")
    threshold = int(Fraction(probability) * _WORD_SPAN)
    if threshold >= _WORD_SPAN:
        return np.ones(size, dtype=bool)
    return random_words(size, rng) < np.uint64(threshold)


def integers_below(bound: int, size: int, rng: RandomSource = None) -> np.ndarray:
    """Exactly uniform integers in ``[0, bound)`` by rejection (no modulo bias)."""
    if not 1 <= bound < _WORD_SPAN:
        raise ValueError(f"bound must be in [1, 2**64); got {bound}")
    accept_below = np.uint64(_WORD_SPAN - _WORD_SPAN % bound - 1)  # inclusive, fits in uint64
    result = np.empty(size, dtype=np.uint64)
    filled = 0
    while filled < size:
        words = random_words(size - filled, rng)
        words = words[words <= accept_below]
        result[filled : filled + len(words)] = words % np.uint64(bound)
        filled += len(words)
    return result.astype(np.int64)
