"""Buckets: the PSI runs on one slice of the ids at a time, so memory follows the slice.

Both parties put an id in bucket ``H(id) mod B`` (``H`` the first 8 bytes of the id's digest,
:func:`bucket_of`), with ``B`` from the larger of the two announced set sizes
(:func:`bucket_count`); equal ids land in the same bucket, so the intersection is the union of
the buckets' intersections. Each bucket is run as its own KKRT16 instance on fresh OT-extension
columns.

A bucket's true size would tell the peer a little about which digests a party holds, so each
party pads every bucket with random dummy digests to :func:`padded_size`, a bound that depends
only on the party's set size and ``B`` (exceeded with probability below 2^-40: Bernstein's
inequality for a sum of Bernoulli variables, union bound over the buckets). The peer therefore
sees the set size, which PSI discloses anyway, and nothing per bucket. Dummies match nothing
except with probability 2^-120 per pair (they are random 120-bit digests).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from core.psi_ot.primitives import prg

#: Target ids per bucket (of the larger set). Buckets are also the pipeline's stages: while S
#: evaluates bucket k, R extends bucket k + 1, so both parties work at once; 2^17 gives 8
#: stages at a million ids for about 3% of padding and a few hundred MiB per party (measured:
#: docs/protocols/psi.md). ``PRIVREG_PSI_BUCKET_IDS`` changes it (both parties must run the
#: same: the size messages carry it); the tests lower it to run many buckets on small sets.
BUCKET_IDS = max(int(os.environ.get("PRIVREG_PSI_BUCKET_IDS", 1 << 17)), 16)
_FAILURE_BITS = 40


class BucketError(ValueError):
    """A bucket holds more ids than its padded size (probability below 2^-40)."""


def bucket_count(own_size: int, peer_size: int, bucket_ids: int) -> int:
    """``B``: the larger set in slices of about ``bucket_ids`` ids (one bucket when it fits)."""
    return max(1, math.ceil(max(own_size, peer_size) / bucket_ids))


def bucket_of(digests: np.ndarray, buckets: int) -> np.ndarray:
    """The bucket of each ``(n, 16)`` digest: its first 8 bytes (little endian) mod ``B``."""
    words = np.ascontiguousarray(digests[:, :8]).view("<u8").ravel()
    return (words % np.uint64(buckets)).astype(np.int64)


def padded_size(size: int, buckets: int) -> int:
    """Ids per bucket after padding: the mean plus Bernstein's deviation at 2^-40 over ``B``
    buckets, never more than ``size`` (a bucket cannot hold more than the whole set)."""
    if buckets == 1:
        return size
    mean = size / buckets
    log_term = _FAILURE_BITS * math.log(2) + math.log(buckets)
    deviation = log_term / 3 + math.sqrt(log_term**2 / 9 + 2 * log_term * mean)
    return min(size, math.ceil(mean + deviation))


def pad(digests: np.ndarray, size: int, key: bytes, stream: int, where: str) -> np.ndarray:
    """``digests`` followed by random dummy digests (the PRG of the party's key) up to
    ``size`` rows; the dummies have a zero last byte like real digests."""
    real = len(digests)
    if real > size:
        raise BucketError(
            f"{where}: a bucket holds {real} ids, above its padded size {size} (probability "
            "below 2^-40; run again under a new job id)"
        )
    out = np.zeros((size, 16), dtype=np.uint8)
    out[:real] = digests
    dummies = np.frombuffer(prg(key, 15 * (size - real), stream), dtype=np.uint8)
    out[real:, :15] = dummies.reshape(-1, 15)
    return out


@dataclass(frozen=True)
class Plan:
    """What both parties derive from the two announced sizes: roles, buckets, padded sizes."""

    receiver: bool  # this party runs the OPRF receiver's side
    buckets: int
    own_size: int
    peer_size: int
    #: Unbalanced sets: R's whole set fits one bucket, so R builds one cuckoo table (one OT
    #: extension, unpadded) that S evaluates each of its buckets against. R's cost then grows
    #: with S's set only by the OPRF values it receives, not by padding or a matrix per bucket.
    one_table: bool = False

    @property
    def own_padded(self) -> int:
        """Ids per bucket of this party (R's whole set when it has one table)."""
        if self.one_table and self.receiver:
            return self.own_size
        return padded_size(self.own_size, self.buckets)

    @property
    def peer_padded(self) -> int:
        """Ids per bucket of the peer (R's whole set when it has one table)."""
        if self.one_table and not self.receiver:
            return self.peer_size
        return padded_size(self.peer_size, self.buckets)

    @property
    def compared_buckets(self) -> int:
        """How many of S's buckets meet one cuckoo table of R (for the output length)."""
        return self.buckets if self.one_table else 1

    def matrix_round(self, bucket: int) -> int:
        """The bucket whose matrix (and OT-extension stream) S evaluates ``bucket`` with."""
        return 0 if self.one_table else bucket
