"""ECDH private set intersection over X25519 (semi-honest, both parties learn the result).

Each party hashes its canonical ids to 32-byte X25519 u-coordinates and multiplies them by a
secret scalar; the other party multiplies them again. Scalar multiplication commutes, so an
id held by both ends up as the same doubly-blinded value on both sides, while an id held by
one party only stays a random-looking point under a key the other party never sees (the
decisional Diffie-Hellman assumption on Curve25519 and its twist, which X25519 is designed
to be secure on). Messages in order:

1. A -> B: A's blinded ids ``H(a)^x``, sorted (sorting random values hides the row order);
   B -> A likewise ``H(b)^y``.
2. B -> A: ``(H(a)^x)^y`` in the order A sent; A -> B: ``(H(b)^y)^x`` likewise. Each party
   keeps the doubly-blinded values it computed for the peer.
3. Each party intersects its own doubly-blinded values with the peer's set and keeps its rows
   in the intersection, sorted by doubly-blinded value, so both sides end in the same order
   without either revealing a row order.

Each side learns the other's set size and the intersection (as its own rows), nothing more.
``cryptography``'s X25519 is a vetted constant-time implementation; ids are hashed with a
domain-separated SHA-256, which RFC 7748 allows as an arbitrary u-coordinate input.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from core.ids import IdError, canonical_id

POINT_BYTES = 32
_DOMAIN = b"privreg/psi/x25519/v1\x00"
_PARALLEL_MIN = 20_000


class PsiError(ValueError):
    """Bad PSI input, or an intersection too small to release."""


class PeerRefusedError(PsiError):
    """The peer refused to release the intersection; its own error says why, this side's
    only reports it (so a local run shows the peer's)."""

    reports_peer = True


def new_key() -> bytes:
    """A fresh secret scalar (X25519 clamps it)."""
    return secrets.token_bytes(32)


def hash_ids(ids: Sequence[object]) -> np.ndarray:
    """Canonicalise and hash ids to points; refuses nulls and duplicate canonical ids."""
    points = np.empty((len(ids), POINT_BYTES), dtype=np.uint8)
    seen: dict[bytes, int] = {}
    for row, value in enumerate(ids):
        try:
            key = canonical_id(value)
        except IdError as error:
            raise PsiError(f"id at row {row + 1}: {error}") from None
        if key in seen:
            raise PsiError(f"id at row {row + 1} duplicates row {seen[key] + 1} ({value!r})")
        seen[key] = row
        points[row] = np.frombuffer(hashlib.sha256(_DOMAIN + key).digest(), dtype=np.uint8)
    return points


def _blind_chunk(key: bytes, chunk: bytes) -> bytes:
    private = X25519PrivateKey.from_private_bytes(key)
    from_bytes = X25519PublicKey.from_public_bytes
    out = bytearray(len(chunk))
    for start in range(0, len(chunk), POINT_BYTES):
        out[start : start + POINT_BYTES] = private.exchange(
            from_bytes(chunk[start : start + POINT_BYTES])
        )
    return bytes(out)


def blind(points: np.ndarray, key: bytes, workers: int | None = None) -> np.ndarray:
    """Multiply every point by the secret scalar; uses a process pool for large inputs."""
    if points.ndim != 2 or points.shape[1] != POINT_BYTES:
        raise PsiError(f"expected an (n, {POINT_BYTES}) array of points")
    if len(points) == 0:
        return points.copy()
    workers = workers if workers is not None else (os.cpu_count() or 1)
    data = np.ascontiguousarray(points, dtype=np.uint8).tobytes()
    if workers <= 1 or len(points) < _PARALLEL_MIN:
        out = _blind_chunk(key, data)
    else:
        chunks = np.array_split(np.arange(len(points)), workers * 4)
        pieces = [data[c[0] * POINT_BYTES : (c[-1] + 1) * POINT_BYTES] for c in chunks if len(c)]
        with ProcessPoolExecutor(max_workers=workers) as pool:
            out = b"".join(pool.map(_blind_chunk, [key] * len(pieces), pieces))
    return np.frombuffer(out, dtype=np.uint8).reshape(-1, POINT_BYTES).copy()


def _as_void(points: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(points).view(np.dtype((np.void, POINT_BYTES))).ravel()


def sort_points(points: np.ndarray) -> np.ndarray:
    """Row order that sorts the points bytewise."""
    return np.argsort(_as_void(points), kind="stable")


@dataclass(frozen=True)
class BlindedSet:
    """A party's first message, plus the private order needed to map answers back to rows."""

    blinded: np.ndarray  # (n, 32), sorted bytewise: safe to send
    rows: np.ndarray  # rows[i] is the table row of blinded[i]: stays with the party


def prepare(ids: Sequence[object], key: bytes, workers: int | None = None) -> BlindedSet:
    """Step 1: blind one's own ids and sort them."""
    blinded = blind(hash_ids(ids), key, workers)
    order = sort_points(blinded)
    return BlindedSet(blinded[order], order.astype(np.int64))


def check_peer_points(points: object, peer: str, what: str) -> np.ndarray:
    """Refuse a peer's message that is not a set of distinct 32-byte points.

    Honest blinded values of distinct ids are distinct; a repeated value could only come from
    a peer that sends the same point twice to count or probe, so it is refused, naming the
    peer and the first repeated position.
    """
    array = np.asarray(points)
    if array.dtype != np.uint8 or array.ndim != 2 or array.shape[1] != POINT_BYTES:
        raise PsiError(
            f"{what} from {peer} is malformed: expected an (n, {POINT_BYTES}) array of bytes, "
            f"got dtype {array.dtype} and shape {array.shape}"
        )
    values = _as_void(array)
    _, first, counts = np.unique(values, return_index=True, return_counts=True)
    if (counts > 1).any():
        position = int(np.min(first[counts > 1]))
        raise PsiError(
            f"{what} from {peer} repeats the point at position {position}: refused (an honest "
            "peer's blinded ids are distinct)"
        )
    return array


def reblind(
    peer_blinded: np.ndarray, key: bytes, workers: int | None = None, peer: str = "the peer"
) -> np.ndarray:
    """Step 2: blind the peer's values again, keeping their order (refuses malformed sets)."""
    checked = check_peer_points(peer_blinded, peer, "the blinded ids")
    try:
        return blind(checked, key, workers)
    except ValueError as error:  # X25519 refuses low-order points (an all-zero result)
        raise PsiError(f"the blinded ids from {peer} hold an invalid point: {error}") from None


@dataclass(frozen=True)
class Intersection:
    rows: np.ndarray  # own table rows in the intersection, in the shared aligned order
    own_size: int
    peer_size: int

    @property
    def size(self) -> int:
        return len(self.rows)


def intersect(
    own_double: np.ndarray, own_rows: np.ndarray, peer_double: np.ndarray, peer: str = "the peer"
) -> Intersection:
    """Step 3: own rows whose doubly-blinded value the peer also has, in sorted-value order."""
    own_double = check_peer_points(own_double, peer, "the doubly-blinded answer")
    if len(own_double) != len(own_rows):
        raise PsiError(
            f"the doubly-blinded answer from {peer} has {len(own_double)} values for the "
            f"{len(own_rows)} ids sent"
        )
    own, peer = _as_void(own_double), _as_void(peer_double)
    hit = np.isin(own, peer)
    matched = np.flatnonzero(hit)
    order = matched[np.argsort(own[matched], kind="stable")]
    return Intersection(own_rows[order], len(own_double), len(peer_double))


def check_release(result: Intersection, min_rows: int) -> None:
    """Refuse empty and small intersections: tiny ones single out individuals."""
    check_release_size(result.size, result.own_size, result.peer_size, min_rows)


def check_release_size(size: int, own_size: int, peer_size: int, min_rows: int) -> None:
    """:func:`check_release` from the counts alone (the rows may not be in memory)."""
    if size == 0:
        raise PsiError(
            f"the intersection is empty ({own_size} ids here, {peer_size} at the peer): "
            "nothing to align"
        )
    if size < min_rows:
        raise PsiError(
            f"the intersection has {size} rows, below min_rows={min_rows}; refusing "
            "to release it because small intersections leak membership"
        )


def plaintext_intersection(a: Iterable[object], b: Iterable[object]) -> set[bytes]:
    """The reference the protocol must equal (used in tests and benchmarks)."""
    return {canonical_id(x) for x in a} & {canonical_id(x) for x in b}
