"""VOLE-based PSI at RR22's communication (244-264 bits per id counted from the messages here,
the paper's own 251; KKRT16 here: 944), both parties learning the intersection, run bucket by
bucket like KKRT16 (:mod:`.protocol`), as steps that exchange plain messages.

Raghuraman and Rindal, "Blazing Fast PSI from Improved OKVS and Subfield VOLE", ACM CCS 2022,
the semi-honest protocol: the receiver R encodes an OKVS ``P`` with ``Decode(P, y) = H(y)``
for each of its items (:mod:`.okvs`, a random-band OKVS); a random VOLE ``C = B + A Delta``
(R holds ``A``, ``C``; the sender S holds ``B``, ``Delta``; :mod:`.vole`, silent) lets R send
``P + A``, from which S gets ``K = B + Delta (P + A) = C + Delta P``. Then for every ``x``:
``Decode(K, x) + Delta H(x) = Decode(C, x) + Delta (Decode(P, x) + H(x))``, equal to R's
``Decode(C, x)`` when ``x`` is in R's set and masked by ``Delta`` (unknown to R) otherwise. S
sends ``H'(Decode(K, x) + Delta H(x))`` for its items, truncated to ``40 + log2(n_R n_S)``
bits; R compares with ``H'(Decode(C, y))`` for its own.

Roles, buckets, padding and ids are KKRT16's (:func:`.protocol.plan`: the smaller set is R;
:mod:`.buckets`). Messages (``round`` is the bucket where one is sent per bucket):

0. both ways ``size`` (:func:`.protocol.size_message`).
1. R -> S ``hello``: base-OT setup (R is the base-OT sender), once per job.
2. S -> R ``reply``: base-OT choices, the bits of ``Delta``, once per job.
3. R -> S ``extend`` (per bucket): the correlated-OT columns ``u`` and the code key.
4. S -> R ``vole`` (per bucket): GGM level sums under OTs, and ``gamma``.
5. R -> S ``okvs`` (per bucket): the OKVS key and ``P + A``.
6. S -> R ``values`` (per bucket): ``H'`` of each padded item, in S's secret order ``pi``.
7. R -> S ``result`` (size, released), then ``matched`` per bucket: one bit per position of
   S's order (a bitmap: at most 1 bit per id, less than KKRT16's 64-bit positions when more
   than one id in 64 matches).

What each party learns: its peer's set size and the intersection, nothing more (semi-honest).
S sees ``u`` (R's choice bits under a PRG it holds one seed of per pair) and ``P + A`` with
``A`` pseudorandom under dual LPN: nothing about R's set. R sees the VOLE messages, which hide
``Delta`` and ``B``, and S's values, pseudorandom except where they match R's own; the bitmap
tells S which of its items matched, as KKRT16's positions do. Bucket sizes are padded to
public bounds. Randomness is the AES-CTR stream of the party's job key (:mod:`.primitives`):
a retried step recomputes the very message it sent, and only that key is kept between steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.psi import Intersection, PsiError
from core.psi_ot import base_ot, buckets, gf128, okvs, vole
from core.psi_ot.buckets import Plan
from core.psi_ot.primitives import prg, prg_array, random_permutation, row_hash
from core.psi_ot.protocol import (
    _array,
    _base_ot,
    _bytes,
    _first_repeat,
    _matches,
)

STATISTICAL_BITS = 40
_OUTPUT_DOMAIN = b"privreg-rr22-H'"
# disjoint PRG streams of a party's key: once per job ...
_BASE_OT_SENDER, _BASE_OT_RECEIVER, _DELTA = 1, 2, 3
# ... and per bucket (see _stream)
_PERMUTATION, _DUMMIES, _VOLE_SEED, _CODE_KEY, _FILLER, _OKVS_KEY_FIRST = 5, 6, 7, 8, 9, 16
_OKVS_ATTEMPTS = 8

KIND_SIZE, KIND_HELLO, KIND_REPLY = "psi_rr22_size", "psi_rr22_hello", "psi_rr22_reply"
KIND_EXTEND, KIND_VOLE, KIND_OKVS = "psi_rr22_extend", "psi_rr22_vole", "psi_rr22_okvs"
KIND_VALUES, KIND_RESULT, KIND_MATCHED = "psi_rr22_values", "psi_rr22_result", "psi_rr22_matched"


def _stream(purpose: int, bucket: int) -> int:
    """The PRG stream of one use in one bucket (disjoint from the once-per-job streams)."""
    return (bucket + 1) << 8 | purpose


def output_bytes(receiver_size: int, sender_size: int) -> int:
    """Truncation of ``H'``: 40 bits beyond the log of the number of comparisons."""
    comparisons = max(receiver_size, 1) * max(sender_size, 1)
    return min(16, math.ceil((STATISTICAL_BITS + math.log2(comparisons)) / 8))


def vole_shape(plan: Plan) -> vole.Shape:
    """The VOLE of one of R's tables: one position per OKVS column."""
    receiver_padded = plan.own_padded if plan.receiver else plan.peer_padded
    return vole.shape(okvs.columns(receiver_padded))


def _width(plan: Plan) -> int:
    receiver, sender = (
        (plan.own_padded, plan.peer_padded)
        if plan.receiver
        else (plan.peer_padded, plan.own_padded)
    )
    return output_bytes(receiver, sender * plan.compared_buckets)


def _output_hash(values: np.ndarray, width: int) -> np.ndarray:
    """``H'`` (BLAKE2b as the random oracle, truncated) of ``(n, 2)`` uint64 field elements."""
    return row_hash(
        np.ascontiguousarray(values).view(np.uint8).reshape(-1, 16), width, _OUTPUT_DOMAIN
    )


# ---- once per job ---------------------------------------------------------------------------


def hello(key: bytes) -> dict[str, Any]:
    """Step 1 (R): the base-OT setup."""
    return {"base_ot": base_ot.sender_setup(key, _BASE_OT_SENDER).message()}


def _delta(key: bytes) -> bytes:
    return prg(key, 16, _DELTA)


@functools.lru_cache(maxsize=4)
def _chosen(key: bytes, setup: bytes) -> base_ot.ReceiverChoice:
    """S's base-OT choices (``Delta``'s bits) and chosen seeds, once per job and process."""
    return base_ot.receiver_choose(setup, vole.delta_bits(_delta(key)), key, _BASE_OT_RECEIVER)


@functools.lru_cache(maxsize=4)
def _pairs(key: bytes, choice_message: bytes) -> list[tuple[bytes, bytes]]:
    """R's base-OT seed pairs, once per job and process."""
    setup = base_ot.sender_setup(key, _BASE_OT_SENDER)
    return base_ot.sender_keys(setup, choice_message, vole.WIDTH)


def forget_base_ots() -> None:
    """Drop the base-OT seeds kept for this process's jobs (when a job's secrets go)."""
    _chosen.cache_clear()
    _pairs.cache_clear()


def _sender_chosen(key: bytes, hello_message: object, peer: str) -> base_ot.ReceiverChoice:
    setup = _bytes(hello_message, "base_ot", 2 * base_ot.POINT_BYTES, "hello", peer)
    return _base_ot(lambda: _chosen(key, setup), "hello", peer)


def reply(key: bytes, hello_message: object, peer: str) -> dict[str, Any]:
    """Step 2 (S): the base-OT choices, chosen by the bits of ``Delta``."""
    return {"base_ot": _sender_chosen(key, hello_message, peer).message}


# ---- the receiver R -------------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiverVole:
    """R's side of one table's VOLE between its extend and its OKVS message."""

    cots: vole.ReceiverCots
    code_key: bytes
    shape: vole.Shape


def extend(
    key: bytes, reply_message: object, plan: Plan, bucket: int, peer: str
) -> tuple[dict[str, Any], ReceiverVole]:
    """Step 3 (R): the correlated-OT columns of one table's VOLE, and what R keeps."""
    choices = _bytes(reply_message, "base_ot", vole.WIDTH * base_ot.POINT_BYTES, "reply", peer)
    pairs = _base_ot(lambda: _pairs(key, choices), "reply", peer)
    shape = vole_shape(plan)
    seed = prg(key, 16, _stream(_VOLE_SEED, bucket))
    u, cots = vole.receiver_extend(seed, pairs, shape, bucket)
    code_key = prg(key, 16, _stream(_CODE_KEY, bucket))
    return {"u": u, "code_key": code_key}, ReceiverVole(cots, code_key, shape)


@dataclass(frozen=True)
class ReceiverState:
    """What R keeps from its OKVS message to its match: ``H'(Decode(C, y))`` of its real
    items, and the size of S's padded bucket."""

    outputs: np.ndarray  # (n_R, width)
    peer_size: int


def encode(
    key: bytes,
    digests: np.ndarray,
    kept: ReceiverVole,
    vole_message: object,
    plan: Plan,
    bucket: int,
    peer: str,
) -> tuple[dict[str, Any], ReceiverState]:
    """Step 5 (R): finish the VOLE with S's message, encode the OKVS of the table's items
    (padded with dummies), send ``P + A``; keep the outputs of the real items."""
    shape = kept.shape
    levels = _array(vole_message, "levels", (shape.noise, shape.depth, 2, 16), "vole", peer)
    gamma = _array(vole_message, "gamma", (shape.noise, 16), "vole", peer)
    a, c = vole.receiver_vole(kept.cots, levels, gamma, shape, kept.code_key, bucket)
    real = len(digests)
    padded = buckets.pad(
        digests, plan.own_padded, key, _stream(_DUMMIES, bucket), f"bucket {bucket}"
    )
    filler = prg_array(key, (shape.m, 16), _stream(_FILLER, bucket)).view("<u8").reshape(-1, 2)
    for attempt in range(_OKVS_ATTEMPTS):
        okvs_key = prg(key, 16, _stream(_OKVS_KEY_FIRST + attempt, bucket))
        starts, band = okvs.bands(okvs_key, padded, shape.m)
        try:
            table = okvs.encode(starts, band, okvs.item_hash(okvs_key, padded), filler)
        except okvs.OkvsError:
            continue
        own = okvs.decode(c, starts[:real], band[:real])
        outputs = _output_hash(own, _width(plan))
        message = {"okvs_key": okvs_key, "table": (table ^ a).view(np.uint8).reshape(-1, 16)}
        return message, ReceiverState(outputs, plan.peer_padded)
    raise PsiError(f"the OKVS encoding failed {_OKVS_ATTEMPTS} times for {real} ids")


@dataclass(frozen=True)
class ReceiverMatch:
    result: Intersection  # R's rows (of the bucket's real items), in position order
    positions: np.ndarray  # ascending positions in S's order


def match(state: ReceiverState, values_message: object, peer: str) -> ReceiverMatch:
    """Step 7 (R): own items whose output S sent, ordered by S's position."""
    n_s, width = state.peer_size, state.outputs.shape[1]
    values = _array(values_message, "values", (n_s, width), "values", peer)
    if (position := _first_repeat(values)) is not None:
        raise PsiError(
            f"the values message from {peer} repeats a value at position {position}: refused "
            "(an honest sender's values are distinct)"
        )
    own, theirs = _matches(state.outputs, values)
    order = np.argsort(theirs, kind="stable")
    result = Intersection(own[order].astype(np.int64), len(state.outputs), n_s)
    return ReceiverMatch(result, theirs[order].astype(np.int64))


def matched_message(positions: np.ndarray, peer_size: int) -> dict[str, Any]:
    """Step 7 (R), per bucket after a release: one bit per position of S's padded bucket."""
    bits = np.zeros(peer_size, dtype=np.uint8)
    bits[np.asarray(positions, dtype=np.int64)] = 1
    return {"matched": np.packbits(bits, bitorder="little")}


# ---- the sender S ---------------------------------------------------------------------------


def sender_vole(
    key: bytes, hello_message: object, extend_message: object, plan: Plan, bucket: int, peer: str
) -> vole.SenderVole:
    """Step 4 (S): the VOLE message of one of R's tables and S's share ``B`` (recomputed the
    same from the same messages, so S may keep it or compute it again for step 6)."""
    shape = vole_shape(plan)
    u = _array(extend_message, "u", (vole.WIDTH, shape.padded // 8), "extend", peer)
    code_key = _bytes(extend_message, "code_key", 16, "extend", peer)
    chosen = _sender_chosen(key, hello_message, peer)
    delta = _delta(key)
    q = vole.sender_extend(chosen.keys, delta, u, shape, bucket)
    seed = prg(key, 16, _stream(_VOLE_SEED, bucket))
    return vole.sender_vole(seed, delta, q, shape, code_key, bucket)


def _ordered(key: bytes, digests: np.ndarray, plan: Plan, bucket: int) -> np.ndarray:
    padded = buckets.pad(
        digests, plan.own_padded, key, _stream(_DUMMIES, bucket), f"bucket {bucket}"
    )
    return padded[random_permutation(key, len(padded), _stream(_PERMUTATION, bucket))]


def values(
    key: bytes,
    digests: np.ndarray,
    b: np.ndarray,
    okvs_message: object,
    plan: Plan,
    bucket: int,
    peer: str,
) -> dict[str, Any]:
    """Step 6 (S): ``H'(Decode(K, x) + Delta H(x))`` for each padded item of the bucket in
    S's secret order, ``K = B + Delta (P + A)`` from R's table of this bucket."""
    m = len(b)
    okvs_key = _bytes(okvs_message, "okvs_key", 16, "okvs", peer)
    masked = gf128.to_words(_array(okvs_message, "table", (m, 16), "okvs", peer))
    delta = _delta(key)
    k = b ^ gf128.mul_const(delta, masked)
    ordered = _ordered(key, digests, plan, bucket)
    starts, band = okvs.bands(okvs_key, ordered, m)
    own = okvs.decode(k, starts, band) ^ gf128.mul_const(delta, okvs.item_hash(okvs_key, ordered))
    return {"values": _output_hash(own, _width(plan))}


def sender_rows(
    key: bytes, real: int, plan: Plan, bucket: int, matched_message: object, peer: str
) -> tuple[np.ndarray, np.ndarray]:
    """Step 8 (S): ``(positions, rows)``: the matched positions of S's order (ascending) and
    the indices (among its ``real`` items of the bucket) at them. Refuses a malformed bitmap,
    more matches than R's bucket holds ids, or a dummy (see :func:`.protocol.sender_rows` on
    what S cannot check)."""
    size = plan.own_padded
    bits = _array(matched_message, "matched", (-(-size // 8),), "matched", peer)
    flags = np.unpackbits(bits, bitorder="little")
    if flags[size:].any():
        raise PsiError(f"the matched message from {peer} for bucket {bucket} marks padding bits")
    positions = np.flatnonzero(flags[:size]).astype(np.int64)
    if len(positions) > plan.peer_padded:
        raise PsiError(
            f"the matched message from {peer} for bucket {bucket} names {len(positions)} "
            f"matches, more than the {plan.peer_padded} ids it holds per bucket"
        )
    order = random_permutation(key, size, _stream(_PERMUTATION, bucket))
    rows = order[positions]
    if (rows >= real).any():
        raise PsiError(f"the matched message from {peer} for bucket {bucket} names a dummy")
    return positions, rows
