"""Cuckoo hashing with three hash functions and no stash, as KKRT's PSI places the receiver's
items: each item sits in one of its three candidate bins, every bin holds at most one item.

Table size: ``ceil(1.27 n)`` bins, the stash-less choice for three hash functions at failure
probability 2^-40 determined by Pinkas, Schneider, Weinert and Wieder (Eurocrypt 2018,
"Efficient circuit-based PSI via cuckoo hashing") and used since by Pinkas, Schneider, Tkachenko
and Yanai (Eurocrypt 2019). Below 1024 items their extrapolation does not apply, so small
tables get ``2 n + 16`` bins; if insertion still fails, the receiver draws a fresh hash key
(:class:`CuckooError`), which happens with negligible probability at the sizes above.

Insertion is the parallel form of the usual random walk (every homeless item tries its next
candidate bin at once, one of the contenders per bin wins, the previous occupant is evicted
and tries its next bin in the next round), so numpy does the work and Python loops per round.
"""

from __future__ import annotations

import math

import numpy as np

from core.psi_ot.primitives import aes_blocks

HASHES = 3
_MAX_ROUNDS = 2000


class CuckooError(RuntimeError):
    """The items did not fit under this hash key (negligible at the sizes used)."""


def table_size(n: int) -> int:
    """Number of bins for ``n`` items."""
    return math.ceil(1.27 * n) if n >= 1024 else 2 * n + 16


def candidate_bins(hash_key: bytes, digests: np.ndarray, bins: int) -> np.ndarray:
    """The three candidate bins of each item, ``(n, 3)`` int64: AES under the public hash key of
    the item digest tagged with the function's number, read as an integer mod ``bins``."""
    out = np.empty((len(digests), HASHES), dtype=np.int64)
    for c in range(HASHES):
        blocks = digests.copy()
        blocks[:, 15] = 0x80 | c
        words = aes_blocks(hash_key, blocks)[:, :8].copy().view("<u8").ravel()
        out[:, c] = (words % np.uint64(bins)).astype(np.int64)
    return out


def place(candidates: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(table, choice)``: ``table[b]`` is the item in bin ``b`` or -1, and
    ``choice[i]`` which of its hash functions placed item ``i``. Raises :class:`CuckooError`."""
    n = len(candidates)
    table = np.full(bins, -1, dtype=np.int64)
    choice = np.zeros(n, dtype=np.int64)
    pending = np.arange(n, dtype=np.int64)
    for _ in range(_MAX_ROUNDS):
        if len(pending) == 0:
            return table, choice
        targets = candidates[pending, choice[pending]]
        target_bins, first = np.unique(targets, return_index=True)
        winners = pending[first]
        evicted = table[target_bins]
        evicted = evicted[evicted >= 0]
        table[target_bins] = winners
        lost = np.ones(len(pending), dtype=bool)
        lost[first] = False
        pending = np.concatenate([pending[lost], evicted])
        choice[pending] = (choice[pending] + 1) % HASHES
    raise CuckooError(f"{len(pending)} of {n} items found no bin after {_MAX_ROUNDS} rounds")
