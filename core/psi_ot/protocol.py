"""KKRT16 PSI (the paper's PSI application of the BaRK-OPRF, with cuckoo hashing), both
parties learning the intersection, run bucket by bucket, as steps that exchange plain messages.

Messages, each a dict the channel's codec carries (``round`` is the bucket where one is sent
per bucket):

0. both ways ``size``: the party's set size and the bucket size it runs with. The party with
   the smaller set (the first name on a tie) is the OPRF *receiver* R, the other the *sender*
   S: the OT extension then grows with the small set (see :func:`plan`). Both derive the
   bucket count ``B`` and the padded bucket sizes from the two sizes (:mod:`.buckets`).
1. R -> S ``hello``: R's base-OT setup (it is the base-OT sender), once per job.
2. S -> R ``reply``: S's base-OT choice message (choice bits ``s``) and the pseudorandom
   code's key, once per job.
3. R -> S ``matrix`` (per bucket): R cuckoo-hashes its bucket (padded with dummies) into ``m``
   bins under a hash key it draws, one OPRF instance per bin with input ``x || c`` (``c`` the
   hash function that placed ``x``); sends the OT-extension columns ``u`` (a fresh stretch of
   the base OTs' PRG per bucket), the hash key and ``m``.
4. S -> R ``values`` (per bucket): for each of its bucket's items ``y`` (in a random order
   ``pi`` that S keeps) and each ``c`` in 0..2, the OPRF of bin ``h_c(y)`` at ``y || c``,
   truncated to ``40 + log2(m * 3 n_S)`` bits so that a false match has probability below
   2^-40.
5. R -> S ``result`` once every bucket is matched: the intersection's size and whether R
   releases it (``min_rows``); then ``positions`` per bucket: the matched positions in S's
   order, ascending. Both parties order their rows by (bucket, position) (random to both:
   ``pi`` is S's secret, the positions are S's own items), so row ``k`` of R's aligned table
   is row ``k`` of S's.

Each learns the other's set size and the intersection (S from R's positions; the semi-honest
model trusts R to report them), nothing more: bucket sizes are padded to public bounds. A
party's randomness is the AES-CTR stream of a 16-byte key it draws from the OS CSPRNG once per
job (:func:`new_party_key`): a retried step recomputes the very message it sent, and only that
key is kept between steps.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from core.ids import IdError, canonical_id
from core.psi import Intersection, PeerRefusedError, PsiError
from core.psi_ot import base_ot, buckets, cuckoo, kkrt
from core.psi_ot.buckets import Plan
from core.psi_ot.primitives import prg, random_key, random_permutation

STATISTICAL_BITS = 40
T = TypeVar("T")
_DOMAIN = b"privreg/psi-ot/item/v1\x00"
# disjoint PRG streams of a party's key: once per job ...
_BASE_OT_SENDER, _BASE_OT_RECEIVER, _CHOICES, _CODE_KEY = 1, 2, 3, 4
# ... and per bucket (see _stream)
_PERMUTATION, _DUMMIES, _HASH_KEY_FIRST = 5, 6, 16  # R's hash key, attempt a: 16 + a
_HASH_ATTEMPTS = 8

KIND_SIZE, KIND_HELLO, KIND_REPLY = "psi_kkrt_size", "psi_kkrt_hello", "psi_kkrt_reply"
KIND_MATRIX, KIND_VALUES = "psi_kkrt_matrix", "psi_kkrt_values"
KIND_RESULT, KIND_POSITIONS = "psi_kkrt_result", "psi_kkrt_positions"


def _stream(purpose: int, bucket: int) -> int:
    """The PRG stream of one use in one bucket (disjoint from the once-per-job streams)."""
    return (bucket + 1) << 8 | purpose


def new_party_key() -> bytes:
    """The party's secret for one job, from the OS CSPRNG."""
    return random_key()


def size_message(size: int, bucket_ids: int = buckets.BUCKET_IDS) -> dict[str, Any]:
    """Step 0 (both): the own set size and the bucket size this party runs with."""
    return {"size": size, "bucket_ids": bucket_ids}


def plan(party: str, peer: str, size: int, bucket_ids: int, peer_message: object) -> Plan:
    """Step 0 (both): roles, bucket count and padded sizes from the two size messages.

    The smaller set's party is the OPRF receiver (the first name on a tie): the OT extension
    (64 bytes per cuckoo bin, expanded and transposed by both) then follows the small set,
    and the large set costs only its truncated OPRF values."""
    if party == peer:
        raise PsiError(f"both sides are party {party!r}; PSI needs two parties")
    peer_size = _size(peer_message, "size", peer)
    peer_bucket_ids = _field(peer_message, "bucket_ids", "size", peer)
    if peer_bucket_ids != bucket_ids:
        raise PsiError(
            f"the size message from {peer} asks for buckets of {peer_bucket_ids!r} ids, this "
            f"party runs {bucket_ids}: both must run the same privreg PSI settings"
        )
    receiver = (size, party) < (peer_size, peer)
    count = buckets.bucket_count(size, peer_size, bucket_ids)
    one_table = count > 1 and min(size, peer_size) <= bucket_ids
    return Plan(receiver, count, size, peer_size, one_table)


def item_digests(ids: Sequence[object], party: str, first_row: int = 0) -> np.ndarray:
    """``(n, 16)`` blocks: 15 bytes of SHA-256 of each canonical id, a zero byte for ``c``.

    Refuses nulls, unsupported types and duplicate canonical ids, naming the party and rows
    (1-based, counted from ``first_row`` for a slice of a longer column).
    """
    parts = []
    start = hashlib.sha256(_DOMAIN)  # copied per id: cheaper than hashing the prefix again
    for row, value in enumerate(ids, start=first_row):
        try:
            key = canonical_id(value)
        except IdError as error:
            raise PsiError(f"{party}: id at row {row + 1}: {error}") from None
        state = start.copy()
        state.update(key)
        parts.append(state.digest()[:15])
    digests = np.zeros((len(parts), 16), dtype=np.uint8)
    if parts:
        digests[:, :15] = np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(-1, 15)
    if (repeat := first_duplicate(digests)) is not None:
        row, first = repeat
        raise PsiError(
            f"{party}: id at row {first_row + row + 1} duplicates row {first_row + first + 1} "
            f"({ids[row]!r})"
        )
    return digests


def first_duplicate(digests: np.ndarray) -> tuple[int, int] | None:
    """``(row, first)``: the lowest row whose digest an earlier row has, and that earlier row.

    Equal canonical ids have equal digests; unequal ones collide with probability 2^-120.
    """
    left, right = _equal_neighbours(digests)
    if not len(left):
        return None
    later, earlier = np.maximum(left, right), np.minimum(left, right)
    at = int(np.argmin(later))
    return int(later[at]), int(earlier[at])


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


def hello(key: bytes) -> dict[str, Any]:
    """Step 1 (R): the base-OT setup."""
    return {"base_ot": base_ot.sender_setup(key, _BASE_OT_SENDER).message()}


@dataclass(frozen=True)
class ReceiverState:
    """What R keeps from step 3 to step 5 of a bucket: its OPRF outputs per real item and each
    item's ``c``, and the size of S's padded bucket."""

    outputs: np.ndarray  # (n_R, out_bytes)
    choice: np.ndarray  # (n_R,) hash function that placed the item
    peer_size: int


def _placement(
    key: bytes, digests: np.ndarray, bucket: int
) -> tuple[bytes, int, np.ndarray, np.ndarray]:
    bins = cuckoo.table_size(len(digests))
    for attempt in range(_HASH_ATTEMPTS):
        hash_key = prg(key, 16, _stream(_HASH_KEY_FIRST + attempt, bucket))
        candidates = cuckoo.candidate_bins(hash_key, digests, bins)
        try:
            table, choice = cuckoo.place(candidates, bins)
        except cuckoo.CuckooError:
            continue
        return hash_key, bins, table, choice
    raise PsiError(f"cuckoo hashing failed {_HASH_ATTEMPTS} times for {len(digests)} ids")


@dataclass(frozen=True)
class ReceiverTable:
    """R's cuckoo table of one bucket: its own digests padded with dummies and placed. It
    needs only R's key, so R builds it while S's reply is on its way."""

    real: int  # R's real items (the first rows of ``digests``)
    digests: np.ndarray
    hash_key: bytes
    bins: int
    table: np.ndarray
    choice: np.ndarray


def receiver_table(key: bytes, digests: np.ndarray, plan: Plan, bucket: int) -> ReceiverTable:
    """Step 3 (R), first half: the bucket's cuckoo table (with ``plan.one_table``, bucket 0
    holds R's whole set, unpadded)."""
    real = len(digests)
    where = f"bucket {bucket}"
    digests = buckets.pad(digests, plan.own_padded, key, _stream(_DUMMIES, bucket), where)
    hash_key, bins, table, choice = _placement(key, digests, bucket)
    return ReceiverTable(real, digests, hash_key, bins, table, choice)


@dataclass(frozen=True)
class ReceiverExtension:
    """Step 3 (R), second half: the matrix message, and what R's outputs are computed from
    once it is sent (:meth:`state`: ``H`` runs while S evaluates, not before S can start)."""

    message: dict[str, Any]
    table: ReceiverTable
    items: np.ndarray  # the item in each occupied bin, in bin order
    rows: np.ndarray  # the extension's rows ``t_i`` of those bins
    width: int
    peer_size: int

    def state(self) -> ReceiverState:
        outputs = np.empty((len(self.table.digests), self.width), dtype=np.uint8)
        outputs[self.items] = kkrt.receiver_outputs(self.rows, self.width)
        real = self.table.real
        return ReceiverState(outputs[:real], self.table.choice[:real], self.peer_size)


def extend(
    key: bytes, table: ReceiverTable, reply: object, plan: Plan, bucket: int, peer: str
) -> ReceiverExtension:
    """Step 3 (R), once S's reply is here: the code words of the table's bins and the
    OT-extension columns ``u`` (a fresh stream of the base OTs' PRG per bucket)."""
    code_key = _bytes(reply, "code_key", 16, "reply", peer)
    choice_message = _bytes(reply, "base_ot", kkrt.WIDTH * base_ot.POINT_BYTES, "reply", peer)
    pairs = _base_ot(lambda: _base_ot_pairs(key, choice_message), "reply", peer)
    occupied = np.flatnonzero(table.table >= 0)
    items = table.table[occupied]
    inputs = table.digests[items].copy()
    inputs[:, 15] = table.choice[items]
    codes = np.zeros((table.bins, kkrt.CODE_BYTES), dtype=np.uint8)
    codes[occupied] = kkrt.pseudorandom_code(kkrt.code_keys(code_key), inputs)
    u, t_rows = kkrt.receiver_matrices(pairs, codes, stream=bucket)
    width = output_bytes(table.bins, plan.peer_padded * plan.compared_buckets)
    message = {"u": u, "hash_key": table.hash_key, "bins": table.bins}
    return ReceiverExtension(message, table, items, t_rows[occupied], width, plan.peer_padded)


def matrix(
    key: bytes, digests: np.ndarray, reply: object, plan: Plan, bucket: int, peer: str
) -> tuple[dict[str, Any], ReceiverState]:
    """Step 3 (R) whole: the OT-extension matrix for one bucket's cuckoo table and R's
    outputs for its real items (:func:`receiver_table`, :func:`extend`, then the state)."""
    extension = extend(key, receiver_table(key, digests, plan, bucket), reply, plan, bucket, peer)
    return extension.message, extension.state()


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
    result: Intersection  # R's rows (of the bucket's real items), in position order
    positions: np.ndarray  # ascending positions in S's order: what R tells S


def match(state: ReceiverState, values_message: object, peer: str) -> ReceiverMatch:
    """Step 5 (R): own items of one bucket whose output S sent under the same ``c``, ordered
    by position."""
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


def result_message(size: int, min_rows: int) -> dict[str, Any]:
    """Step 5 (R), once every bucket is matched: the intersection's size and whether R
    releases the positions (not below its ``min_rows``; an empty intersection is "released":
    S then refuses it as empty, as R does)."""
    return {"size": size, "released": size == 0 or size >= min_rows}


def positions_message(positions: np.ndarray) -> dict[str, Any]:
    """Step 5 (R), per bucket after a release: the matched positions in S's order."""
    return {"positions": np.asarray(positions, dtype=np.int64)}


# ---- the sender S --------------------------------------------------------------------------


def _choice_bits(key: bytes) -> np.ndarray:
    return np.frombuffer(prg(key, kkrt.WIDTH, _CHOICES), dtype=np.uint8) & 1


@functools.lru_cache(maxsize=4)
def _base_ot_pairs(key: bytes, choice_message: bytes) -> list[tuple[bytes, bytes]]:
    """R's seed pairs (its base-OT sender's side): computed once per job and process, as every
    bucket's OT extension stretches the same base OTs (on fresh PRG streams)."""
    return base_ot.sender_keys(
        base_ot.sender_setup(key, _BASE_OT_SENDER), choice_message, kkrt.WIDTH
    )


@functools.lru_cache(maxsize=4)
def _base_ot_chosen(key: bytes, setup: bytes) -> base_ot.ReceiverChoice:
    """S's choice message and chosen seeds, once per job and process (as above)."""
    return base_ot.receiver_choose(setup, _choice_bits(key).tolist(), key, _BASE_OT_RECEIVER)


def forget_base_ots() -> None:
    """Drop the base-OT seeds kept for the steps of this process's jobs: called when a job's
    secrets are destroyed, so none outlives it in memory either (another running job
    recomputes its own at its next step)."""
    _base_ot_pairs.cache_clear()
    _base_ot_chosen.cache_clear()


def _base_ot_choice(key: bytes, hello_message: object, peer: str) -> base_ot.ReceiverChoice:
    setup = _bytes(hello_message, "base_ot", 2 * base_ot.POINT_BYTES, "hello", peer)
    return _base_ot(lambda: _base_ot_chosen(key, setup), "hello", peer)


def reply(key: bytes, hello_message: object, peer: str) -> dict[str, Any]:
    """Step 2 (S): the base-OT choices and the code key."""
    return {
        "base_ot": _base_ot_choice(key, hello_message, peer).message,
        "code_key": prg(key, 16, _CODE_KEY),
    }


@dataclass(frozen=True)
class SenderBucket:
    """S's items of one bucket, padded, in its secret order, with their code words under each
    hash function: all from S's own key, so S computes them while R's matrix is on its way."""

    ordered: np.ndarray  # (n_S, 16) padded digests in S's order
    codes: np.ndarray  # (HASHES, n_S, 64): C(y || c)


def sender_bucket(key: bytes, digests: np.ndarray, plan: Plan, bucket: int) -> SenderBucket:
    """Step 4 (S), first half: pad, permute and encode the bucket's items."""
    digests = buckets.pad(
        digests, plan.own_padded, key, _stream(_DUMMIES, bucket), f"bucket {bucket}"
    )
    order = random_permutation(key, len(digests), _stream(_PERMUTATION, bucket))
    ordered = digests[order]
    code = kkrt.code_keys(prg(key, 16, _CODE_KEY))
    codes = np.empty((cuckoo.HASHES, len(ordered), kkrt.CODE_BYTES), dtype=np.uint8)
    inputs = ordered.copy()
    for c in range(cuckoo.HASHES):
        inputs[:, 15] = c
        codes[c] = kkrt.pseudorandom_code(code, inputs)
    return SenderBucket(ordered, codes)


def evaluate(
    key: bytes,
    prepared: SenderBucket,
    hello_message: object,
    matrix_message: object,
    plan: Plan,
    bucket: int,
    peer: str,
) -> dict[str, Any]:
    """Step 4 (S), once R's matrix is here: the OPRF of each prepared item under each hash
    function, in S's secret order."""
    expected = cuckoo.table_size(plan.peer_padded)
    bins = _field(matrix_message, "bins", "matrix", peer)
    if bins != expected:
        raise PsiError(
            f"the matrix message from {peer} for bucket {bucket} has {bins!r} bins, not the "
            f"{expected} of its {plan.peer_padded} ids per bucket"
        )
    hash_key = _bytes(matrix_message, "hash_key", 16, "matrix", peer)
    u = _array(matrix_message, "u", (kkrt.WIDTH, -(-bins // 8)), "matrix", peer)
    chosen = _base_ot_choice(key, hello_message, peer)
    bits = _choice_bits(key)
    q_rows = kkrt.sender_rows(chosen.keys, bits, u, bins, stream=plan.matrix_round(bucket))
    mask = kkrt.choice_mask(bits)
    candidates = cuckoo.candidate_bins(hash_key, prepared.ordered, bins)
    count = len(prepared.ordered)
    width = output_bytes(bins, count * plan.compared_buckets)
    out = np.empty((cuckoo.HASHES, count, width), dtype=np.uint8)
    for c in range(cuckoo.HASHES):
        out[c] = kkrt.sender_outputs(q_rows, mask, candidates[:, c], prepared.codes[c], width)
    return {"values": out}


def values(
    key: bytes,
    digests: np.ndarray,
    hello_message: object,
    matrix_message: object,
    plan: Plan,
    bucket: int,
    peer: str,
) -> dict[str, Any]:
    """Step 4 (S) whole: :func:`sender_bucket`, then :func:`evaluate`."""
    prepared = sender_bucket(key, digests, plan, bucket)
    return evaluate(key, prepared, hello_message, matrix_message, plan, bucket, peer)


def released_size(result: object, peer: str) -> int:
    """Step 6 (S): the intersection's size when R released it; refuses otherwise."""
    if not isinstance(result, dict) or not result.get("released", False):
        count = result.get("size") if isinstance(result, dict) else None
        raise PeerRefusedError(
            f"{peer} refused to release the intersection of {count!r} rows (below its min_rows "
            "or empty)"
        )
    return _size(result, "result", peer)


def sender_rows(
    key: bytes, real: int, plan: Plan, bucket: int, positions_message: object, peer: str
) -> np.ndarray:
    """Step 6 (S): the indices (among its ``real`` items of the bucket) at R's positions, in
    position order; refuses positions out of range, not strictly ascending (so unique), on a
    dummy, or more than R's bucket holds ids.

    What S cannot check (plain KKRT16 has no proof of R's outputs): that each position is a
    real match. A malicious R can name any of S's real items of the bucket instead, without
    knowing their ids (S's order ``pi`` is secret), and can leave real matches out; see the
    threat model (docs/threat-model.md)."""
    positions = np.asarray(_field(positions_message, "positions", "positions", peer))
    size = plan.own_padded
    if positions.dtype != np.int64 or positions.ndim != 1:
        raise PsiError(f"the positions message from {peer} is malformed: they must be int64")
    if len(positions) > plan.peer_padded:  # R cannot match more items than it has
        raise PsiError(
            f"the positions message from {peer} for bucket {bucket} names {len(positions)} "
            f"matches, more than the {plan.peer_padded} ids it holds per bucket"
        )
    if len(positions) and (
        positions[0] < 0 or positions[-1] >= size or (np.diff(positions) <= 0).any()
    ):
        raise PsiError(
            f"the positions message from {peer} for bucket {bucket} has positions out of range "
            f"or not strictly ascending (padded bucket size {size})"
        )
    order = random_permutation(key, size, _stream(_PERMUTATION, bucket))
    rows = order[positions]
    if (rows >= real).any():  # probability 2^-120 per pair for an honest receiver
        raise PsiError(f"the positions message from {peer} for bucket {bucket} names a dummy")
    return rows
