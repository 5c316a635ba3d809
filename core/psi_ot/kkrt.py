"""KKRT16's batched, related-key OPRF (BaRK-OPRF): IKNP-style OT extension with a pseudorandom
code in place of the repetition code (the paper's BaRK-OPRF protocol; its steps are listed
below with the function implementing each).

Roles are the OPRF's: the *receiver* holds one input per bin, the *sender* holds the key
``(s, q_1..q_m)`` and can evaluate the OPRF of bin ``i`` at any input. Step by step:

1. ``k = 512`` base OTs with the roles reversed: the OPRF sender picks ``s`` in {0,1}^k and
   receives the seed ``k_j^{s_j}`` of each pair ``(k_j^0, k_j^1)`` the receiver holds
   (:mod:`.base_ot`).
2. Receiver (:func:`receiver_matrices`): ``d_i = C(r_i)`` is the pseudorandom code of bin
   ``i``'s input, ``t^j = G(k_j^0)`` column ``j`` of ``T``, and it sends the columns
   ``u^j = t^j xor G(k_j^1) xor d^j``.
3. Sender (:func:`sender_rows`): ``q^j = G(k_j^{s_j}) xor s_j u^j``, so row-wise
   ``q_i = t_i xor (C(r_i) and s)``.
4. Outputs: the receiver's is ``H(t_i)`` (:func:`receiver_outputs`); the sender evaluates bin
   ``i`` at ``y`` as ``H(q_i xor (C(y) and s))`` (:func:`sender_outputs`), which equals the
   receiver's exactly when ``C(y) = C(r_i)``. Elsewhere the code words differ in at least
   ``kappa`` = 128 positions (w.h.p.), which ``s`` hides.

``C`` is AES-128 under four keys drawn by the sender (a PRF, so a pseudorandom code in the
paper's sense) over 512 = 4 x 128 bits. The paper's parameter analysis asks for a code of
about 3.5 kappa bits for 2^-40 failure at these sizes; 512 is the next multiple of the block.
``G`` is AES-128-CTR and ``H`` BLAKE2b (:mod:`.primitives`). Everything is vectorised: the one
Python loop per element is ``H``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.psi_ot.bitmatrix import transpose
from core.psi_ot.primitives import KEY_BYTES, aes_blocks, prg, prg_array, row_hash

WIDTH = 512  # code length k, and number of base OTs
CODE_BYTES = WIDTH // 8
_HASH_DOMAIN = b"privreg-kkrt-H1"


def code_keys(prc_key: bytes) -> list[bytes]:
    """The four AES keys of the pseudorandom code, expanded from the sender's one key."""
    data = prg(prc_key, 4 * KEY_BYTES)
    return [data[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(4)]


def pseudorandom_code(keys: Sequence[bytes], blocks: np.ndarray) -> np.ndarray:
    """``C(x)`` for each 16-byte input block: ``(n, 64)`` uint8."""
    return np.concatenate([aes_blocks(key, blocks) for key in keys], axis=1)


def _padded(bins: int) -> int:
    return -(-bins // 8)


def receiver_matrices(
    seed_pairs: Sequence[tuple[bytes, bytes]], codes: np.ndarray, stream: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Step 2: ``(u, t)``: the ``(k, m/8)`` columns ``u^j`` to send and the ``(m, 64)`` rows
    ``t_i`` to keep. ``codes`` holds ``C(r_i)`` per bin (zeros for an empty bin). ``stream``
    picks a fresh stretch of ``G``'s output, so one set of base OTs serves several extensions
    (one per bucket) without ever reusing a column."""
    bins = len(codes)
    if len(seed_pairs) != WIDTH or codes.shape != (bins, CODE_BYTES):
        raise ValueError("receiver_matrices needs 512 seed pairs and (m, 64) code words")
    padded = np.zeros((8 * _padded(bins), CODE_BYTES), dtype=np.uint8)
    padded[:bins] = codes
    columns = transpose(padded)  # (512, m/8): d^j
    t_columns = np.empty_like(columns)
    for j, (k0, k1) in enumerate(seed_pairs):
        t_columns[j] = prg_array(k0, (columns.shape[1],), stream)
        columns[j] ^= t_columns[j] ^ prg_array(k1, (columns.shape[1],), stream)
    return columns, transpose(t_columns)[:bins]


def sender_rows(
    chosen_seeds: Sequence[bytes],
    choice_bits: np.ndarray,
    u: np.ndarray,
    bins: int,
    stream: int = 0,
) -> np.ndarray:
    """Step 3: the ``(m, 64)`` rows ``q_i`` from the chosen seeds and the receiver's ``u``
    (``stream`` as in :func:`receiver_matrices`)."""
    if u.shape != (WIDTH, _padded(bins)):
        raise ValueError(f"u has shape {u.shape}, expected {(WIDTH, _padded(bins))}")
    q_columns = np.empty_like(u)
    for j, seed in enumerate(chosen_seeds):
        q_columns[j] = prg_array(seed, (u.shape[1],), stream)
        if choice_bits[j]:
            q_columns[j] ^= u[j]
    return transpose(q_columns)[:bins]


def choice_mask(choice_bits: np.ndarray) -> np.ndarray:
    """``s`` as 64 bytes in the bit order of the rows."""
    return np.packbits(np.asarray(choice_bits, dtype=np.uint8), bitorder="little")


def receiver_outputs(t_rows: np.ndarray, out_bytes: int) -> np.ndarray:
    """Step 4, receiver: ``H(t_i)`` for the given rows."""
    return row_hash(t_rows, out_bytes, _HASH_DOMAIN)


def sender_outputs(
    q_rows: np.ndarray, mask: np.ndarray, bins: np.ndarray, codes: np.ndarray, out_bytes: int
) -> np.ndarray:
    """Step 4, sender: ``H(q_{bins[e]} xor (codes[e] and s))`` for each element ``e``."""
    return row_hash(q_rows[bins] ^ (codes & mask), out_bytes, _HASH_DOMAIN)
