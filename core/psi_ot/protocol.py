"""KKRT16 PSI (the paper's PSI application of the BaRK-OPRF, with cuckoo hashing), both
parties learning the intersection, as steps that exchange plain messages.

Roles: the party whose name sorts first is the OPRF *receiver* R, the other the *sender* S
(both can tell from the two names alone). Messages, each a dict the channel's codec carries:

1. R -> S ``hello``: R's base-OT setup (it is the base-OT sender) and its set size.
2. S -> R ``reply``: S's base-OT choice message (choice bits ``s``), the pseudorandom code's
   key and its set size.
3. R -> S ``matrix``: R cuckoo-hashes its items into ``m`` bins under a hash key it draws, one
   OPRF instance per bin with input ``x || c`` (``c`` the hash function that placed ``x``);
   sends the OT-extension columns ``u``, the hash key and ``m``.
4. S -> R ``values``: for each of its items ``y`` (in a random order ``pi`` that S keeps) and
   each ``c`` in 0..2, the OPRF of bin ``h_c(y)`` at ``y || c``, truncated to
   ``40 + log2(m * 3 n_S)`` bits so that a false match has probability below 2^-40.
5. R -> S ``result``: R keeps its items whose output S sent under the same ``c``; it sends the
   matched positions in S's order, ascending. Both parties order their rows by that position
   (random to both: ``pi`` is S's secret, the positions are S's own items), so row ``k`` of
   R's aligned table is row ``k`` of S's.

Each learns the other's set size and the intersection (S from R's positions; the semi-honest
model trusts R to report them), nothing more. A party's randomness is the AES-CTR stream of a
16-byte key it draws from the OS CSPRNG once per job (:func:`new_party_key`): a retried step
recomputes the very message it sent, and only that key is kept between steps.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from core.ids import IdError, canonical_id
from core.psi import Intersection, PsiError
from core.psi_ot import base_ot, cuckoo, kkrt
from core.psi_ot.primitives import prg, random_key, random_permutation

STATISTICAL_BITS = 40
T = TypeVar("T")
_DOMAIN = b"privreg/psi-ot/item/v1\x00"
# disjoint PRG streams of a party's key
_BASE_OT_SENDER, _BASE_OT_RECEIVER, _CHOICES, _CODE_KEY, _PERMUTATION = 1, 2, 3, 4, 5
_HASH_KEY_FIRST = 100  # R's hash key for attempt a is stream 100 + a
_HASH_ATTEMPTS = 8

KIND_HELLO, KIND_REPLY, KIND_MATRIX = "psi_kkrt_hello", "psi_kkrt_reply", "psi_kkrt_matrix"
KIND_VALUES, KIND_RESULT = "psi_kkrt_values", "psi_kkrt_result"


def new_party_key() -> bytes:
    """The party's secret for one job, from the OS CSPRNG."""
    return random_key()


def is_receiver(party: str, peer: str) -> bool:
    """The party whose name sorts first runs the OPRF receiver's side."""
    if party == peer:
        raise PsiError(f"both sides are party {party!r}; PSI needs two parties")
    return party < peer


def item_digests(ids: Sequence[object], party: str) -> np.ndarray:
    """``(n, 16)`` blocks: 15 bytes of SHA-256 of each canonical id, a zero byte for ``c``.

    Refuses nulls, unsupported types and duplicate canonical ids, naming the party and rows.
    """
    seen: dict[bytes, int] = {}
    parts = []
    start = hashlib.sha256(_DOMAIN)  # copied per id: cheaper than hashing the prefix again
    for row, value in enumerate(ids):
        try:
            key = canonical_id(value)
        except IdError as error:
            raise PsiError(f"{party}: id at row {row + 1}: {error}") from None
        if (first := seen.setdefault(key, row)) != row:
            raise PsiError(f"{party}: id at row {row + 1} duplicates row {first + 1} ({value!r})")
        state = start.copy()
        state.update(key)
        parts.append(state.digest()[:15])
    digests = np.zeros((len(parts), 16), dtype=np.uint8)
    if parts:
        digests[:, :15] = np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(-1, 15)
    return digests


def output_bytes(bins: int, sender_size: int) -> int:
    """Truncation of the OPRF outputs: 40 bits beyond the log of the number of comparisons."""
    comparisons = max(bins, 1) * max(3 * sender_size, 1)
    return min(16, math.ceil((STATISTICAL_BITS + math.log2(comparisons)) / 8))


# ---- message checks (everything a peer sends is refused unless well formed) ----------------


def _field(message: object, name: str, kind: str, peer: str) -> Any:
    if not isinstance(message, dict) or name not in message:
        raise PsiError(f"the {kind} message from {peer} is malformed: it has no {name!r}")
    return message[name]


def _size(message: object, kind: str, peer: str) -> int:
    size = _field(message, "size", kind, peer)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise PsiError(f"the {kind} message from {peer} gives the invalid set size {size!r}")
    return size


def _bytes(message: object, name: str, length: int, kind: str, peer: str) -> bytes:
    value = _field(message, name, kind, peer)
    if not isinstance(value, bytes) or len(value) != length:
        got = len(value) if isinstance(value, bytes) else type(value).__name__
        raise PsiError(
            f"the {kind} message from {peer} is malformed: {name} must be {length} bytes, got {got}"
        )
    return value


def _array(message: object, name: str, shape: tuple[int, ...], kind: str, peer: str) -> np.ndarray:
    value = _field(message, name, kind, peer)
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.shape != shape:
        got = (value.dtype, value.shape) if isinstance(value, np.ndarray) else type(value).__name__
        raise PsiError(
            f"the {kind} message from {peer} is malformed or truncated: {name} must be uint8 "
            f"of shape {shape}, got {got}"
        )
    return value


def _base_ot(call: Callable[[], T], kind: str, peer: str) -> T:
    """Run a base-OT step, turning its refusal into a :class:`PsiError` naming the peer."""
    try:
        return call()
    except base_ot.BaseOtError as error:
        raise PsiError(f"the {kind} message from {peer} is refused: {error}") from None


# ---- the receiver R ------------------------------------------------------------------------


def hello(key: bytes, size: int) -> dict[str, Any]:
    """Step 1 (R): the base-OT setup and R's set size."""
    return {"base_ot": base_ot.sender_setup(key, _BASE_OT_SENDER).message(), "size": size}


@dataclass(frozen=True)
class ReceiverState:
    """What R keeps from step 3 to step 5: its OPRF outputs per item and each item's ``c``."""

    outputs: np.ndarray  # (n_R, out_bytes)
    choice: np.ndarray  # (n_R,) hash function that placed the item
    peer_size: int


def _placement(key: bytes, digests: np.ndarray) -> tuple[bytes, int, np.ndarray, np.ndarray]:
    bins = cuckoo.table_size(len(digests))
    for attempt in range(_HASH_ATTEMPTS):
        hash_key = prg(key, 16, _HASH_KEY_FIRST + attempt)
        candidates = cuckoo.candidate_bins(hash_key, digests, bins)
        try:
            table, choice = cuckoo.place(candidates, bins)
        except cuckoo.CuckooError:
            continue
        return hash_key, bins, table, choice
    raise PsiError(f"cuckoo hashing failed {_HASH_ATTEMPTS} times for {len(digests)} ids")


def matrix(
    key: bytes, digests: np.ndarray, reply: object, peer: str
) -> tuple[dict[str, Any], ReceiverState]:
    """Step 3 (R): the OT-extension matrix for R's cuckoo table, and R's own outputs."""
    peer_size = _size(reply, "reply", peer)
    code_key = _bytes(reply, "code_key", 16, "reply", peer)
    choice_message = _bytes(reply, "base_ot", kkrt.WIDTH * base_ot.POINT_BYTES, "reply", peer)
    secret = base_ot.sender_setup(key, _BASE_OT_SENDER)
    pairs = _base_ot(lambda: base_ot.sender_keys(secret, choice_message, kkrt.WIDTH), "reply", peer)
    hash_key, bins, table, choice = _placement(key, digests)
    occupied = np.flatnonzero(table >= 0)
    items = table[occupied]
    inputs = digests[items].copy()
    inputs[:, 15] = choice[items]
    codes = np.zeros((bins, kkrt.CODE_BYTES), dtype=np.uint8)
    codes[occupied] = kkrt.pseudorandom_code(kkrt.code_keys(code_key), inputs)
    u, t_rows = kkrt.receiver_matrices(pairs, codes)
    outputs = np.empty((len(digests), output_bytes(bins, peer_size)), dtype=np.uint8)
    outputs[items] = kkrt.receiver_outputs(t_rows[occupied], outputs.shape[1])
    message = {"u": u, "hash_key": hash_key, "bins": bins}
    return message, ReceiverState(outputs, choice, peer_size)


def _prefix_keys(values: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each value (zero-padded) as one uint64 sort key."""
    padded = np.zeros((len(values), 8), dtype=np.uint8)
    width = min(8, values.shape[1])
    padded[:, :width] = values[:, :width]
    return padded.view("<u8").ravel()


def _equal_neighbours(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(i, j)`` of rows with equal values, found as neighbours in sorted order.

    Sorting by an 8-byte prefix is exact unless three rows share a prefix (probability about
    n^3 / 2^128); then the rows are sorted by their full bytes instead.
    """
    keys = _prefix_keys(values)
    order = np.argsort(keys)
    same = keys[order][1:] == keys[order][:-1]
    if (same[1:] & same[:-1]).any():  # a run of three: sort exactly, by every byte
        order = np.lexsort(values.T[::-1])
        same = (values[order][1:] == values[order][:-1]).all(axis=1)
    at = np.flatnonzero(same)
    left, right = order[at], order[at + 1]
    equal = (values[left] == values[right]).all(axis=1)
    return left[equal], right[equal]


def _first_repeat(values: np.ndarray) -> int | None:
    """Lowest position of a value that occurs more than once, or ``None``."""
    left, right = _equal_neighbours(values)
    return int(np.minimum(left, right).min()) if len(left) else None


def _matches(mine: np.ndarray, theirs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs ``(i, j)`` with ``mine[i] == theirs[j]``; both sides hold distinct values."""
    left, right = _equal_neighbours(np.concatenate([mine, theirs]))
    own, other = np.minimum(left, right), np.maximum(left, right) - len(mine)
    keep = (own < len(mine)) & (other >= 0)  # one of each side, not two of one side
    return own[keep], other[keep]


@dataclass(frozen=True)
class ReceiverMatch:
    result: Intersection
    positions: np.ndarray  # ascending positions in S's order: what R tells S


def match(state: ReceiverState, values_message: object, peer: str) -> ReceiverMatch:
    """Step 5 (R): own items whose output S sent under the same ``c``, ordered by position."""
    n_s, width = state.peer_size, state.outputs.shape[1]
    values = _array(values_message, "values", (cuckoo.HASHES, n_s, width), "values", peer)
    rows, positions = [], []
    for c in range(cuckoo.HASHES):
        if (position := _first_repeat(values[c])) is not None:
            raise PsiError(
                f"the values message from {peer} repeats a value at position {position} of "
                f"hash function {c}: refused (an honest sender's values are distinct)"
            )
        mine = np.flatnonzero(state.choice == c)
        own_index, their_index = _matches(state.outputs[mine], values[c])
        rows.append(mine[own_index])
        positions.append(their_index)
    all_rows, all_positions = np.concatenate(rows), np.concatenate(positions)
    order = np.argsort(all_positions, kind="stable")
    result = Intersection(all_rows[order].astype(np.int64), len(state.outputs), n_s)
    return ReceiverMatch(result, all_positions[order].astype(np.int64))


def result_message(found: ReceiverMatch, min_rows: int) -> dict[str, Any]:
    """Step 5 (R): the positions, or only the count when R's ``min_rows`` refuses release
    (an empty intersection is "released": S then refuses it as empty, as R does)."""
    size = found.result.size
    released = size == 0 or size >= min_rows
    positions = found.positions if released else np.zeros(0, dtype=np.int64)
    return {"size": size, "released": released, "positions": positions}


# ---- the sender S --------------------------------------------------------------------------


def _choice_bits(key: bytes) -> np.ndarray:
    return np.frombuffer(prg(key, kkrt.WIDTH, _CHOICES), dtype=np.uint8) & 1


def _base_ot_choice(key: bytes, hello_message: object, peer: str) -> base_ot.ReceiverChoice:
    setup = _bytes(hello_message, "base_ot", 2 * base_ot.POINT_BYTES, "hello", peer)
    bits = _choice_bits(key).tolist()
    return _base_ot(
        lambda: base_ot.receiver_choose(setup, bits, key, _BASE_OT_RECEIVER), "hello", peer
    )


def reply(key: bytes, size: int, hello_message: object, peer: str) -> dict[str, Any]:
    """Step 2 (S): the base-OT choices, the code key and S's set size."""
    _size(hello_message, "hello", peer)
    return {
        "base_ot": _base_ot_choice(key, hello_message, peer).message,
        "code_key": prg(key, 16, _CODE_KEY),
        "size": size,
    }


def values(
    key: bytes, digests: np.ndarray, hello_message: object, matrix_message: object, peer: str
) -> dict[str, Any]:
    """Step 4 (S): the OPRF of each own item under each hash function, in S's secret order."""
    peer_size = _size(hello_message, "hello", peer)
    bins = _field(matrix_message, "bins", "matrix", peer)
    if bins != cuckoo.table_size(peer_size):
        raise PsiError(
            f"the matrix message from {peer} has {bins!r} bins, not the "
            f"{cuckoo.table_size(peer_size)} of its {peer_size} ids"
        )
    hash_key = _bytes(matrix_message, "hash_key", 16, "matrix", peer)
    u = _array(matrix_message, "u", (kkrt.WIDTH, -(-bins // 8)), "matrix", peer)
    chosen = _base_ot_choice(key, hello_message, peer)
    bits = _choice_bits(key)
    q_rows = kkrt.sender_rows(chosen.keys, bits, u, bins)
    mask = kkrt.choice_mask(bits)
    order = random_permutation(key, len(digests), _PERMUTATION)
    ordered = digests[order]
    candidates = cuckoo.candidate_bins(hash_key, ordered, bins)
    code = kkrt.code_keys(prg(key, 16, _CODE_KEY))
    width = output_bytes(bins, len(digests))
    out = np.empty((cuckoo.HASHES, len(digests), width), dtype=np.uint8)
    for c in range(cuckoo.HASHES):
        inputs = ordered.copy()
        inputs[:, 15] = c
        codes = kkrt.pseudorandom_code(code, inputs)
        out[c] = kkrt.sender_outputs(q_rows, mask, candidates[:, c], codes, width)
    return {"values": out}


def sender_result(key: bytes, size: int, peer_size: int, result: object, peer: str) -> Intersection:
    """Step 6 (S): own rows at R's positions, in position order; refuses bad positions."""
    if not isinstance(result, dict) or not result.get("released", False):
        count = result.get("size") if isinstance(result, dict) else None
        raise PsiError(
            f"{peer} refused to release the intersection of {count!r} rows (below its min_rows "
            "or empty)"
        )
    positions = np.asarray(_field(result, "positions", "result", peer))
    if positions.dtype != np.int64 or positions.ndim != 1:
        raise PsiError(f"the result message from {peer} is malformed: positions must be int64")
    if len(positions) and (
        positions[0] < 0 or positions[-1] >= size or (np.diff(positions) <= 0).any()
    ):
        raise PsiError(
            f"the result message from {peer} has positions out of range or not strictly "
            f"ascending (own set size {size})"
        )
    order = random_permutation(key, size, _PERMUTATION)
    return Intersection(order[positions], size, peer_size)
