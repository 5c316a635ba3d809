"""Symmetric building blocks of the OT-extension PSI, all from the OS CSPRNG and OpenSSL's AES.

* :func:`random_key`: a fresh 16-byte key from ``secrets`` (the OS CSPRNG). Every other random
  value is the AES-128-CTR key stream of such a key (:func:`prg`), which is also KKRT's PRG
  ``G`` that expands a base-OT seed into a column of the OT-extension matrix. A party keeps only
  its keys between steps, so a retried step recomputes the very message it sent before.
* :func:`aes_blocks`: AES-128-ECB over many 16-byte blocks in one OpenSSL call (the
  pseudorandom code and the cuckoo hash functions are AES under keys both parties know).
* :func:`row_hash`: BLAKE2b over each row of a byte matrix, KKRT's random oracle ``H``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 16
_PARALLEL_ROWS = 200_000


def random_key() -> bytes:
    """16 bytes from the OS CSPRNG."""
    return secrets.token_bytes(KEY_BYTES)


def prg(key: bytes, length: int, stream: int = 0) -> bytes:
    """``length`` pseudorandom bytes: AES-128-CTR under ``key``; ``stream`` picks a disjoint
    counter range (the top 32 bits of the initial counter block), so one key serves several
    independent uses."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a PRG key has {KEY_BYTES} bytes, got {len(key)}")
    nonce = stream.to_bytes(4, "big") + bytes(12)
    encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()
    return encryptor.update(bytes(length)) + encryptor.finalize()


def prg_array(key: bytes, shape: tuple[int, ...], stream: int = 0) -> np.ndarray:
    """A uint8 array of the given shape filled by :func:`prg`."""
    size = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(prg(key, size, stream), dtype=np.uint8).reshape(shape).copy()


def random_permutation(key: bytes, n: int, stream: int = 0) -> np.ndarray:
    """A random permutation of ``range(n)``: the order of ``n`` 64-bit PRG values (uniform
    unless two values tie, which has probability below n^2 / 2^65)."""
    values = prg_array(key, (n, 8), stream).view("<u8").ravel()
    return np.argsort(values, kind="stable").astype(np.int64)


def aes_blocks(key: bytes, blocks: np.ndarray) -> np.ndarray:
    """AES-128 of each 16-byte row of ``blocks`` (shape (n, 16), uint8)."""
    data = np.ascontiguousarray(blocks, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 16:
        raise ValueError(f"expected (n, 16) blocks, got shape {data.shape}")
    encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    out = encryptor.update(data.tobytes()) + encryptor.finalize()
    return np.frombuffer(out, dtype=np.uint8).reshape(data.shape).copy()


def _hash_chunk(data: bytes, width: int, out_bytes: int, domain: bytes) -> bytes:
    # copying one initialised state is about a third cheaper than a fresh object per row
    start, view, out = hashlib.blake2b(digest_size=out_bytes, person=domain), memoryview(data), []
    for i in range(0, len(view), width):
        state = start.copy()
        state.update(view[i : i + width])
        out.append(state.digest())
    return b"".join(out)


def row_hash(
    rows: np.ndarray, out_bytes: int, domain: bytes, workers: int | None = None
) -> np.ndarray:
    """BLAKE2b of each row (personalised by ``domain``), truncated to ``out_bytes``.

    KKRT models ``H`` as a random oracle; BLAKE2b is the fastest standard hash in Python's
    library (about 1 us per 64-byte row: the one per-row Python loop of the protocol, so large
    inputs are split over a process pool, ``workers`` processes, default one per core).
    """
    data = np.ascontiguousarray(rows, dtype=np.uint8)
    count, width = data.shape
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers <= 1 or count < _PARALLEL_ROWS:
        joined = _hash_chunk(data.tobytes(), width, out_bytes, domain)
    else:
        pieces = [c.tobytes() for c in np.array_split(data, 4 * workers) if len(c)]
        with ProcessPoolExecutor(max_workers=workers) as pool:
            joined = b"".join(
                pool.map(
                    _hash_chunk,
                    pieces,
                    [width] * len(pieces),
                    [out_bytes] * len(pieces),
                    [domain] * len(pieces),
                )
            )
    return np.frombuffer(joined, dtype=np.uint8).reshape(count, out_bytes).copy()
