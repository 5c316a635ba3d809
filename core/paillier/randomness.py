"""Randomizers ("obfuscators") for Paillier encryption and re-randomization.

An obfuscator is an element that is an n-th residue modulo n^2; multiplying a ciphertext by a
fresh one re-randomizes it without changing the plaintext. Computing r^n mod n^2 dominates
encryption cost, so this module offers three sources:

* :class:`StandardRandomizer` -- r^n with r uniform in Z_n^* (Paillier 1999). The default.
* :class:`DJNRandomizer` -- h_s^a with a short random exponent a and a fixed-base table.
* :class:`ObfuscatorPool` -- values of either kind computed ahead of need (in parallel or in a
  background thread) and handed out exactly once.

All randomness comes from :mod:`secrets` (the OS CSPRNG).
"""

from __future__ import annotations

import functools
import math
import secrets
import threading
from collections import deque
from typing import Protocol

import gmpy2
from gmpy2 import mpz
from phe.paillier import PaillierPublicKey

from core.paillier.errors import PaillierError
from core.paillier.parallel import SERIAL, Backend, chunk_bounds

_MIN_PARALLEL_CHUNK = 8


class Randomizer(Protocol):
    """A source of fresh obfuscators for one public key."""

    @property
    def n(self) -> int:
        """The public modulus the obfuscators belong to."""
        ...

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        """``count`` fresh, never-reused n-th residues modulo n^2."""
        ...


def random_unit(n: int | mpz) -> mpz:
    """Uniform element of Z_n^* drawn from the OS CSPRNG."""
    n_int = int(n)
    while True:
        candidate = mpz(secrets.randbelow(n_int - 1) + 1)
        if gmpy2.gcd(candidate, n_int) == 1:
            return candidate


def standard_obfuscators(n: int, count: int) -> list[mpz]:
    """``count`` values r^n mod n^2 (plain-int arguments so worker processes can run it)."""
    n_mpz = mpz(n)
    bases = [random_unit(n_mpz) for _ in range(count)]
    return gmpy2.powmod_base_list(bases, n_mpz, n_mpz * n_mpz)


def _parallel_generate(
    backend: Backend, function: object, fixed_args: tuple[object, ...], count: int
) -> list[mpz]:
    parts = min(backend.parallelism, max(1, count // _MIN_PARALLEL_CHUNK))
    if parts <= 1:
        return function(*fixed_args, count)  # type: ignore[operator]
    sizes = [stop - start for start, stop in chunk_bounds(count, parts)]
    chunks = backend.run(function, [(*fixed_args, size) for size in sizes], sensitive=False)  # type: ignore[arg-type]
    return [mpz(value) for chunk in chunks for value in chunk]


class StandardRandomizer:
    """Textbook obfuscators r^n mod n^2, r uniform in Z_n^* (one full exponentiation each)."""

    def __init__(self, public_key: PaillierPublicKey) -> None:
        self._n = int(public_key.n)

    @property
    def n(self) -> int:
        return self._n

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        _check_count(count)
        return _parallel_generate(backend or SERIAL, standard_obfuscators, (self._n,), count)


class DJNRandomizer:
    """Damgard-Jurik-Nielsen randomizer h_s^a with a short exponent and a fixed-base table.

    Construction (Damgard, Jurik, Nielsen: "A generalization of Paillier's public-key system
    with applications to electronic voting", Int. J. Inf. Secur. 9(6):371-385, 2010, in the
    section on optimisations and implementation issues): pick a random unit x, set
    h = -x^2 mod n and h_s = h^n mod n^2, and use h_s^a with a uniform in [0, 2^ceil(k/2)) for
    a k-bit n instead of r^n with r uniform in Z_n^*.

    Security argument (our summary of the paper's): h_s^a is an n-th residue, so ciphertexts
    decrypt as usual; for n = pq with p = q = 3 (mod 4) and gcd(p-1, q-1) = 2, -1 is a
    non-square modulo both primes, so h is a non-square of Jacobi symbol 1 whose order is a
    large divisor of lambda(n) except with small probability. Semantic security then follows
    from the decisional composite residuosity (DCR) assumption together with the assumption that
    h^a for a short uniform a cannot be told apart from a uniform element of <h> (a
    short-exponent assumption in a group of unknown order). ``generate_keypair`` produces moduli
    of this shape; with keys from elsewhere ciphertexts remain correct but the argument is not
    established, so prefer the standard randomizer there. The exponent length ceil(k/2) is
    deliberately not configurable.

    Speed: a fixed-base windowing table of h_s^(d * 2^(w*t)) (cf. Brickell, Gordon, McCurley,
    Wilson, EUROCRYPT 1992; for Paillier see Jost, Lam, Maximov, Smeets, "Encryption
    performance improvements of the Paillier cryptosystem", IACR ePrint 2015) turns each
    exponentiation into about ceil(k / (2w)) multiplications: ~128 instead of ~3000 for
    k = 2048, w = 8. The table costs (2^w - 1) * ceil(k / (2w)) residues (~17 MB for w = 8).
    """

    def __init__(self, public_key: PaillierPublicKey, *, window_bits: int = 8) -> None:
        n = int(public_key.n)
        if n % 4 != 1:
            raise PaillierError(
                "DJN randomizer needs n = pq with p = q = 3 (mod 4); this modulus is not "
                "of that shape (n mod 4 != 1), use StandardRandomizer"
            )
        if not 1 <= window_bits <= 12:
            raise PaillierError(f"window_bits must be in [1, 12], got {window_bits}")
        self._n = n
        self._window_bits = window_bits
        self._exponent_bits = math.ceil(n.bit_length() / 2)
        x = random_unit(n)
        h = (-(x * x)) % n
        self._h_s = int(gmpy2.powmod(h, n, mpz(n) * n))

    @property
    def n(self) -> int:
        return self._n

    @property
    def exponent_bits(self) -> int:
        """Length of the random exponent a: ceil(k/2) for a k-bit modulus."""
        return self._exponent_bits

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        _check_count(count)
        fixed = (self._n, self._h_s, self._exponent_bits, self._window_bits)
        return _parallel_generate(backend or SERIAL, djn_obfuscators, fixed, count)


def djn_obfuscators(
    n: int, h_s: int, exponent_bits: int, window_bits: int, count: int
) -> list[mpz]:
    """``count`` values h_s^a mod n^2 for fresh uniform ``exponent_bits``-bit a."""
    table = _fixed_base_table(n, h_s, exponent_bits, window_bits)
    n_square = mpz(n) * n
    mask = (1 << window_bits) - 1
    results = []
    for _ in range(count):
        exponent = secrets.randbits(exponent_bits)
        accumulator = None
        for row in table:
            digit = exponent & mask
            exponent >>= window_bits
            if digit:
                entry = row[digit - 1]
                accumulator = entry if accumulator is None else accumulator * entry % n_square
        results.append(mpz(1) if accumulator is None else accumulator)
    return results


@functools.lru_cache(maxsize=2)
def _fixed_base_table(n: int, h_s: int, exponent_bits: int, window_bits: int) -> list[list[mpz]]:
    """Rows t = 0.. of [h_s^(d * 2^(w t)) for d = 1 .. 2^w - 1]; cached per worker process."""
    n_square = mpz(n) * n
    base = mpz(h_s)
    rows = []
    for _ in range(math.ceil(exponent_bits / window_bits)):
        row = [base]
        for _ in range((1 << window_bits) - 2):
            row.append(row[-1] * base % n_square)
        rows.append(row)
        base = row[-1] * base % n_square
    return rows


class ObfuscatorPool:
    """Obfuscators computed ahead of need, each handed out at most once.

    ``fill`` computes a batch (in parallel with a backend); ``start_background_fill`` keeps a
    daemon thread topping the pool up -- for the standard source the exponentiations run in
    gmpy2 with the GIL released, so this uses an otherwise idle core. When the pool runs dry,
    :meth:`obfuscators` computes the shortfall on demand rather than failing.
    """

    def __init__(self, source: StandardRandomizer | DJNRandomizer) -> None:
        self._source = source
        self._values: deque[mpz] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self.computed_on_demand = 0

    @property
    def n(self) -> int:
        return self._source.n

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def fill(self, count: int, *, backend: Backend | None = None) -> None:
        """Compute ``count`` more obfuscators now and add them to the pool."""
        _check_count(count)
        fresh = self._source.obfuscators(count, backend=backend)
        with self._lock:
            self._values.extend(fresh)

    def start_background_fill(self, target_size: int, *, batch_size: int = 32) -> None:
        """Top the pool up to ``target_size`` in a daemon thread (no-op if one is running)."""
        _check_count(target_size)
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._background_loop, args=(target_size, batch_size), daemon=True
        )
        self._thread.start()

    def _background_loop(self, target_size: int, batch_size: int) -> None:
        try:
            while not self._stop.is_set():
                missing = target_size - len(self)
                if missing <= 0:
                    return
                self.fill(min(batch_size, missing))
        except BaseException as exc:  # surfaced by wait_for_background_fill
            self._background_error = exc

    def wait_for_background_fill(self, timeout: float | None = None) -> None:
        """Block until the background thread finished; re-raise its error if it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._background_error is not None:
            raise PaillierError("background obfuscator fill failed") from self._background_error

    def stop_background_fill(self) -> None:
        """Ask the background thread to stop after its current batch and wait for it."""
        self._stop.set()
        self.wait_for_background_fill()

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        _check_count(count)
        with self._lock:
            taken = [self._values.popleft() for _ in range(min(count, len(self._values)))]
        shortfall = count - len(taken)
        if shortfall:
            self.computed_on_demand += shortfall
            taken.extend(self._source.obfuscators(shortfall, backend=backend))
        return taken


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise PaillierError(f"count must be a non-negative int, got {count!r}")
