"""Cardinality-only PSI: each party learns how many ids the two sets share and the other's set
size, not which rows (issue 27, item 5: "is this collaboration worth it" before a job).

The X25519 protocol of :mod:`core.psi` with the one change of the shuffled Diffie-Hellman
PSI-CA (De Cristofaro, Gasti, Tsudik, CANS 2012): in step 2 a party returns the peer's
doubly-blinded values *sorted*, not in the order received. Sorting pseudorandom values is a
uniform shuffle, so the peer can still count how many of its values meet the other side's
(equal ids meet as equal values) but can no longer tell which of its rows they belong to:
linking ``H(a)^{xy}`` back to ``a`` needs the other party's scalar ``y`` (decisional
Diffie-Hellman). Semi-honest, like the rest of PSI.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core import psi


def answer(peer_blinded: np.ndarray, key: bytes, peer: str = "the peer") -> np.ndarray:
    """Step 2: blind the peer's values again and return them shuffled (sorted bytewise)."""
    doubled = psi.reblind(peer_blinded, key, peer=peer)
    return doubled[psi.sort_points(doubled)]


@dataclass(frozen=True)
class Cardinality:
    size: int  # ids both sets hold
    own_size: int
    peer_size: int


def count(
    own_double: np.ndarray, own_size: int, peer_double: np.ndarray, peer: str = "the peer"
) -> Cardinality:
    """Step 3: how many of one's own doubly-blinded values (returned shuffled by the peer) the
    peer's set also has; refuses an answer that repeats a value or has the wrong length."""
    own = psi.check_peer_points(own_double, peer, "the shuffled answer")
    if len(own) != own_size:
        raise psi.PsiError(
            f"the shuffled answer from {peer} has {len(own)} values for the {own_size} ids sent"
        )
    hits = np.isin(psi._as_void(own), psi._as_void(peer_double))
    return Cardinality(int(hits.sum()), own_size, len(peer_double))


def check_release(result: Cardinality, min_rows: int) -> None:
    """Refuse a count below ``min_rows``: against a tiny set it tells whether one id is in."""
    if result.size < min_rows:
        raise psi.PsiError(
            f"the intersection has fewer than min_rows={min_rows} ids; refusing to release its "
            "size because a small count can single out individuals"
        )
