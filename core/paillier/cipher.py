"""The one Paillier API every encrypted flow uses (vertical LR, WALR): integer operations on
lists of ciphertext ints under ``phe`` key objects (the key format of :mod:`.keys`).

Flows encode fixed-point values themselves, so they need only exact integer operations:
encrypt, add, add a plaintext, multiply by plaintext integers (``X^T [[d]]``, by Pippenger's
bucket method in :mod:`.multiexp`), re-randomise and decrypt to signed integers (CRT, in
:mod:`.decryption`). Large calls run on a process pool over the machine's cores (or a Dask
cluster). The ``randomizer`` argument picks how obfuscators are made; the default is the
fixed-base full-length mode whose security rests on DCR alone (see :mod:`.randomness`).
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

import gmpy2
import numpy as np
from phe import paillier

from core.paillier import kernels, native
from core.paillier.decryption import CrtDecryptor
from core.paillier.errors import KeyMismatchError
from core.paillier.parallel import (
    SERIAL,
    Backend,
    DaskBackend,
    ProcessBackend,
    chunk_bounds,
    for_kernel,
)
from core.paillier.randomness import (
    DEFAULT_RANDOMIZER,
    FixedBaseRandomizer,
    ObfuscatorFile,
    ObfuscatorPool,
    StandardRandomizer,
    make_randomizer,
    pool_path,
    private_folder,
    randomizer_mode,
)

Ciphertexts = list[int]
_PARALLEL_MIN_WORK = 256  # below this, starting work in another process costs more than it saves
# Columns per X^T [[d]] chunk beyond one chunk per worker. A chunk's fixed cost (shipping and
# packing the ciphertexts, converting them to Montgomery form, the biases' product) measured
# about 2.5 columns' worth with the IFMA kernel (30,000 rows at 4096 bits: 0.16 s CPU, and
# 0.065 s a column).
_MIN_CHUNK_COLUMNS = 8
DASK_ADDRESS_VARIABLE = "PRIVREG_DASK_ADDRESS"
_parallel_backend: ProcessBackend | DaskBackend | None = None


def _backend(work: int) -> Backend:
    """Where large calls run, chosen once per process.

    By default a process pool over this machine's cores (work the C kernel does runs on as
    many threads of this process instead: it releases the GIL, and threads share its tables and
    need nothing shipped). When ``PRIVREG_DASK_ADDRESS`` names
    a Dask scheduler (``tcp://host:8786``), the same chunks run on that cluster instead; only
    public-key work is shipped (decryption stays local, so the private key never leaves).
    """
    global _parallel_backend
    if work < _PARALLEL_MIN_WORK:
        return SERIAL
    if _parallel_backend is None:
        address = os.environ.get(DASK_ADDRESS_VARIABLE)
        if address:
            _parallel_backend = DaskBackend(address)
        elif (os.cpu_count() or 1) > 1:
            _parallel_backend = ProcessBackend()
        else:
            return SERIAL
    return _parallel_backend


def _nsquare(public: paillier.PaillierPublicKey) -> gmpy2.mpz:
    return gmpy2.mpz(public.nsquare)


@functools.lru_cache(maxsize=8)
def _randomizer(
    n: int, mode: str, factors: tuple[int, int] | None
) -> StandardRandomizer | FixedBaseRandomizer:
    """One randomizer per key and mode per process (the fixed-base table is built once)."""
    public = paillier.PaillierPublicKey(n)
    private = None if factors is None else paillier.PaillierPrivateKey(public, *factors)
    return make_randomizer(public, mode, private_key=private)


def _obfuscators(
    public: paillier.PaillierPublicKey,
    count: int,
    kind: str = DEFAULT_RANDOMIZER,
    private: paillier.PaillierPrivateKey | None = None,
    pool: ObfuscatorFile | ObfuscatorPool | None = None,
) -> list[gmpy2.mpz]:
    """Fresh n-th residues of the chosen mode; with the key's own ``private`` key the same
    values are computed faster by CRT; a ``pool`` of precomputed ones is drawn from first."""
    if pool is not None:
        if pool.n != public.n:
            raise KeyMismatchError("the obfuscator pool belongs to another public key")
        return pool.obfuscators(count, backend=_backend(count))
    factors = None
    if private is not None:
        if private.public_key.n != public.n:
            raise KeyMismatchError("the private key does not belong to this public key")
        factors = (int(private.p), int(private.q))
    source = _randomizer(public.n, randomizer_mode(kind), factors)
    return source.obfuscators(count, backend=_backend(count))


def party_pool(
    database: str | os.PathLike[str],
    public: paillier.PaillierPublicKey,
    randomizer: str = DEFAULT_RANDOMIZER,
    *,
    private: paillier.PaillierPrivateKey | None = None,
    create: bool = False,
) -> ObfuscatorFile | None:
    """The pool of precomputed obfuscators that the party owning ``database`` keeps for this
    key and mode, or None when it has none (a run without a pool computes them on demand).

    ``create`` makes an empty one (for filling). Values it computes on demand when the pool
    runs dry come from the same randomizer as :func:`encrypt` (CRT with the own ``private``).
    """
    path = pool_path(database, public.n, randomizer)
    if not create and not path.exists():
        return None
    private_folder(Path(path).parent)
    factors = None if private is None else (int(private.p), int(private.q))
    return ObfuscatorFile(path, _randomizer(public.n, randomizer_mode(randomizer), factors))


_AHEAD: dict[tuple[str, int, str], ObfuscatorPool] = {}
_AHEAD_LOCK = threading.Lock()


def ahead_pool(
    owner: str, public: paillier.PaillierPublicKey, randomizer: str = DEFAULT_RANDOMIZER
) -> ObfuscatorPool:
    """``owner``'s obfuscators for this key computed ahead of need, in this process's memory
    only (never written anywhere), each handed out once; a draw beyond them computes the rest.

    Why: an obfuscator does not depend on the value it will hide, so a party can compute the
    ones it draws next while it waits for a peer (:func:`fill_ahead`), taking its encryption
    off the round's critical path. A process keeps one per owner, key and mode; they go when
    the key does (:func:`forget_ahead`) or the process ends."""
    key = (owner, int(public.n), randomizer_mode(randomizer))
    with _AHEAD_LOCK:
        pool = _AHEAD.get(key)
        if pool is None:
            pool = _AHEAD[key] = ObfuscatorPool(_randomizer(public.n, key[2], None))
        return pool


def fill_ahead(pool: ObfuscatorPool, count: int) -> int:
    """Top ``pool`` up to ``count`` values on this machine's cores; returns how many it holds."""
    missing = count - len(pool)
    if missing > 0:
        pool.fill(missing, backend=_backend(missing))
    return len(pool)


def forget_ahead(owner: str, n: int) -> None:
    """Drop ``owner``'s values computed ahead for the key ``n`` (its job has ended)."""
    with _AHEAD_LOCK:
        for key in [k for k in _AHEAD if k[:2] == (owner, int(n))]:
            del _AHEAD[key]


def fill_pool(pool: ObfuscatorFile, count: int, *, batch: int = 4096) -> int:
    """Add ``count`` obfuscators to ``pool`` on this machine's cores, in batches that are each
    durable once written (an interrupted fill keeps what it finished). Returns the pool's size."""
    done = 0
    while done < count:
        size = min(batch, count - done)
        pool.fill(size, backend=_backend(size))
        done += size
    return pool.available()


def encrypt(
    public: paillier.PaillierPublicKey,
    values: Sequence[int],
    randomizer: str = DEFAULT_RANDOMIZER,
    *,
    private: paillier.PaillierPrivateKey | None = None,
    pool: ObfuscatorFile | ObfuscatorPool | None = None,
) -> Ciphertexts:
    """``(1 + m n) u mod n^2`` for each integer ``m`` (negatives as ``n - |m|``), u fresh.

    ``private`` (only for a party encrypting under its *own* key) enables the CRT speed-up.
    """
    n, nsq = gmpy2.mpz(public.n), _nsquare(public)
    noise = _obfuscators(public, len(values), randomizer, private, pool)
    return [int((1 + (gmpy2.mpz(v) % n) * n) * r % nsq) for v, r in zip(values, noise, strict=True)]


def rerandomize(
    public: paillier.PaillierPublicKey,
    cts: Sequence[int],
    randomizer: str = DEFAULT_RANDOMIZER,
    *,
    private: paillier.PaillierPrivateKey | None = None,
    pool: ObfuscatorFile | ObfuscatorPool | None = None,
) -> Ciphertexts:
    """Same plaintexts, fresh randomness: the receiver cannot link them to earlier values."""
    nsq = _nsquare(public)
    noise = _obfuscators(public, len(cts), randomizer, private, pool)
    return [int(gmpy2.mpz(c) * r % nsq) for c, r in zip(cts, noise, strict=True)]


def add(public: paillier.PaillierPublicKey, a: Sequence[int], b: Sequence[int]) -> Ciphertexts:
    nsq = _nsquare(public)
    if len(a) != len(b):
        raise ValueError(f"cannot add ciphertext vectors of lengths {len(a)} and {len(b)}")
    return [int(gmpy2.mpz(x) * y % nsq) for x, y in zip(a, b, strict=True)]


def add_plain(
    public: paillier.PaillierPublicKey, cts: Sequence[int], values: Sequence[int]
) -> Ciphertexts:
    """``[[c + m]]`` without a fresh obfuscator (the caller re-randomises before sending)."""
    n, nsq = gmpy2.mpz(public.n), _nsquare(public)
    return [
        int(gmpy2.mpz(c) * (1 + (gmpy2.mpz(v) % n) * n) % nsq)
        for c, v in zip(cts, values, strict=True)
    ]


def _column_products(
    public: paillier.PaillierPublicKey, cts: Sequence[int], exponents: np.ndarray
) -> list[gmpy2.mpz]:
    """Bucket multi-exponentiation of each exponent column, spread over processes.

    Many columns (a party's features): each process takes whole columns over all rows, so
    no bucket work is repeated, in a few chunks per worker for load balance. Few columns (a
    weighted sum): row blocks, whose partial products are multiplied together.
    """
    nsq = _nsquare(public)
    backend = for_kernel(_backend(exponents.size // 8), native.preferred(nsq))
    columns = exponents.shape[1]
    if columns >= 2 * backend.parallelism > 2:
        # the same number of chunks for every worker (five on two workers made one do three),
        # one each below _MIN_CHUNK_COLUMNS a chunk, up to four (balance on a shared machine)
        per_worker = min(4, max(1, columns // (backend.parallelism * _MIN_CHUNK_COLUMNS)))
        parts = per_worker * backend.parallelism
        shared = [int(c) for c in cts]
        chunks = backend.run(
            kernels.xt_dot_chunk,
            [(int(nsq), shared, exponents[:, a:b]) for a, b in chunk_bounds(columns, parts)],
            sensitive=False,
        )
        return [value for chunk in chunks for value in chunk]
    bounds = chunk_bounds(len(cts), backend.parallelism)
    partials = backend.run(
        kernels.xt_dot_chunk,
        [(int(nsq), list(cts[a:b]), exponents[a:b]) for a, b in bounds],
        sensitive=False,
    )
    products = partials[0]
    for partial in partials[1:]:
        products = [x * y % nsq for x, y in zip(products, partial, strict=True)]
    return products


def weighted_sum(
    public: paillier.PaillierPublicKey, cts: Sequence[int], weights: Sequence[int]
) -> int:
    """``[[sum_i w_i m_i]]`` for plaintext integer weights (negative ones via the inverse)."""
    if len(cts) != len(weights):
        raise ValueError(f"{len(cts)} ciphertexts but {len(weights)} weights")
    if any(abs(int(w)) >= 2**62 for w in weights):
        nsq = _nsquare(public)
        result = gmpy2.mpz(1)
        for c, w in zip(cts, weights, strict=True):
            result = result * gmpy2.powmod(gmpy2.mpz(c), int(w), nsq) % nsq
        return int(result)
    exponents = np.asarray([int(w) for w in weights], dtype=np.int64).reshape(-1, 1)
    return int(_column_products(public, cts, exponents)[0])


def transpose_dot(
    public: paillier.PaillierPublicKey, X_int: np.ndarray, cts: Sequence[int]
) -> Ciphertexts:
    """``X^T [[d]]``: one encrypted sum per column of the integer matrix ``X``."""
    X_int = np.asarray(X_int, dtype=np.int64)
    if X_int.shape[0] != len(cts):
        raise ValueError(f"X has {X_int.shape[0]} rows but [[d]] has {len(cts)} entries")
    return [int(c) for c in _column_products(public, cts, X_int)]


def pack(
    public: paillier.PaillierPublicKey, cts: Sequence[int], slot_bits: int, slots: int
) -> Ciphertexts:
    """``[[sum_j m_j 2^(slot_bits j)]]`` for each run of ``slots`` ciphertexts, by Horner's
    rule (``acc^(2^s) * c``): the key holder then decrypts one value per run. The caller
    keeps the sum below ``n / 2`` (core.vertical_lr.packing derives the margin)."""
    nsq = _nsquare(public)
    groups = [[gmpy2.mpz(c) for c in cts[a : a + slots]] for a in range(0, len(cts), slots)]
    accumulators = [group[-1] for group in groups]
    shift = gmpy2.mpz(1) << slot_bits
    for position in range(slots - 2, -1, -1):
        live = [g for g, group in enumerate(groups) if len(group) > position + 1]
        if not live:
            continue
        shifted = native.fixed_exponent_powers([accumulators[g] for g in live], shift, nsq)
        for g, value in zip(live, shifted, strict=True):
            accumulators[g] = value * groups[g][position] % nsq
    return [int(a) for a in accumulators]


def decrypt(private: paillier.PaillierPrivateKey, cts: Sequence[int]) -> list[int]:
    """Signed integers (plaintexts above n/2 are negatives), by CRT decryption."""
    n = private.public_key.n
    plain = CrtDecryptor(private.p, private.q).decrypt_many(list(cts))
    return [int(m) - n if m > n // 2 else int(m) for m in plain]


def random_masks(count: int, bits: int = 256) -> list[int]:
    """Masks that statistically hide any value below 2^(bits - 80)."""
    return [secrets.randbits(bits) for _ in range(count)]
