"""Randomizers ("obfuscators") for Paillier encryption and re-randomization, and their security.

A Paillier ciphertext of m is (1 + n)^m * u mod n^2 where u, the obfuscator, is an n-th residue
modulo n^2; multiplying a ciphertext by a fresh u re-randomizes it without changing m.
Computing u dominates the cost of encryption. Three modes, named as the flows' ``randomizer``
option takes them (``"djn"`` is kept as an alias of ``"short"``):

``"full"`` (the default) -- u = h_s^r mod n^2 with r uniform in [0, n).
    Construction: Damgard, Jurik, Nielsen, "A generalization of Paillier's public-key system
    with applications to electronic voting", Int. J. Inf. Secur. 9(6):371-385, 2010, in the
    section on optimisations and implementation issues: for n = pq with p = q = 3 (mod 4) and
    gcd(p-1, q-1) = 2, pick a random unit x, put h = -x^2 mod n and h_s = h^n mod n^2.
    Exponent length: k bits for a k-bit n, because that is what makes the argument below
    statistical. The order of h divides |J_n| = phi(n)/2 (J_n: the units of Jacobi symbol 1,
    a cyclic group for moduli of this shape), and n = 2 * phi(n)/2 + (p + q - 1), so r mod
    ord(h) is within statistical distance (p + q)/n < 2^-(k/2 - 2) of uniform. Hence u is
    (up to that distance) a uniform n-th residue of <h>; when h generates J_n, which holds
    unless x^2 falls in a proper subgroup of the squares, this is textbook Paillier with r
    restricted to J_n. The Jacobi symbol is public and efficiently computable, so semantic
    security rests on the decisional composite residuosity (DCR) assumption alone, as for
    textbook Paillier; no assumption about short exponents is involved. The base is fixed, so
    a precomputed table makes each u cost about k / w multiplications (w: window bits).
``"short"`` (opt-in, faster) -- the same construction with r uniform in [0, 2^ceil(k/2)).
    This is DJN's suggested parameter and what SecretFlow HEU (``ZPaillier``) and Intel
    IPCL (its default) do. Half the multiplications, but semantic security then needs DCR
    *plus* the assumption that h^r for a short uniform r cannot be told from a uniform element
    of <h> (a short-exponent assumption in a group of unknown order, of the kind studied for
    discrete-log groups by Koshiba and Kurosawa, 2004); DJN state it as such.
``"standard"`` (opt-in, textbook) -- u = r^n mod n^2 with r uniform in Z_n^*.
    Paillier, "Public-key cryptosystems based on composite degree residuosity classes",
    EUROCRYPT 1999, LNCS 1592, pp. 223-238: semantically secure under DCR. One full
    exponentiation (k-bit exponent modulo n^2) per value, no table possible (the base varies).
    python-paillier, FATE and rust-paillier do this.

Every encrypting party draws its own x, so nobody else chose h; all randomness comes from
:mod:`secrets` (the OS CSPRNG). A party that holds the factorisation (WALR's labels party
encrypts under its own key) computes the very same u modulo p^2 and q^2 (where h_s has order
dividing p - 1 and q - 1, so the exponent shrinks to k/2 bits) and recombines by CRT.

Obfuscators can also be computed ahead of need: :class:`ObfuscatorPool` in memory and
:class:`ObfuscatorFile` on disk. An obfuscator is as secret as the plaintext it will hide
(given u and the ciphertext, anyone recovers m), so a pool file is created readable by its
owner only and every value is claimed under a file lock and the claim is made durable before
the value is used: no value is handed out twice, across processes and restarts.

Where a party keeps its pools (:func:`pool_path`): beside its own database, in a folder only
it can read, one file per public key and mode. A pool is bound to the key n (its header holds
n's digest and the mode; another key's pool is refused) and to the encrypting party, which
fills it itself with its own base h. Which key a pool is filled for, and when, is the flows'
business: vertical LR's key holder can create a job's key ahead of the run and the encrypting
parties fill their pools for it in idle time (see ``tasks/vertical_lr.py``).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import secrets
import stat
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import gmpy2
import numpy as np
from gmpy2 import mpz
from phe.paillier import PaillierPrivateKey, PaillierPublicKey

from core.option_defaults import DEFAULT_RANDOMIZER, FULL, RANDOMIZER_MODES, SHORT, STANDARD
from core.paillier import native
from core.paillier.errors import PaillierError
from core.paillier.parallel import SERIAL, Backend, ThreadBackend, chunk_bounds, for_kernel

_ALIASES = {"djn": SHORT}
DEFAULT_WINDOW_BITS = 12
"""Largest fixed-base window: ceil(b/12) multiplications per value for a b-bit exponent (86
short, 171 full at 2048 bits, against 103 and 205 with 10-bit windows: 16-19% less CPU per
value). Such a table holds 4095 * ceil(b/12) residues modulo n^2: about 190 MB (short) or
380 MB (full) per process and key, and building it costs about 700,000 multiplications
modulo n^2 (4-11 s at 2048 bits here), which only many thousands of values repay. So a
process's table starts at the window that suits the values it has drawn for that key so far
and grows as it draws more (:func:`_window_for`); the results are the same whatever the
window."""
_MIN_PARALLEL_CHUNK = 32
_TABLE_WORTH = 48  # fewer values than this, with no table built yet: plain powmod in C
_TABLE_CACHE_SIZE = 3  # tables are large (see DEFAULT_WINDOW_BITS)
_MIN_WINDOW_BITS = 4


class Randomizer(Protocol):
    """A source of fresh obfuscators for one public key."""

    @property
    def n(self) -> int:
        """The public modulus the obfuscators belong to."""
        ...

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        """``count`` fresh, never-reused n-th residues modulo n^2."""
        ...


def randomizer_mode(name: str) -> str:
    """The canonical mode for a flow's ``randomizer`` option (``"djn"`` means ``"short"``)."""
    mode = _ALIASES.get(name, name)
    if mode not in RANDOMIZER_MODES:
        raise PaillierError(
            f"randomizer must be one of {RANDOMIZER_MODES} (or 'djn' for 'short'), got {name!r}"
        )
    return mode


def make_randomizer(
    public_key: PaillierPublicKey,
    mode: str = DEFAULT_RANDOMIZER,
    *,
    private_key: PaillierPrivateKey | None = None,
) -> StandardRandomizer | FixedBaseRandomizer:
    """The randomizer of ``mode``; with the key's own ``private_key``, the CRT variant."""
    mode = randomizer_mode(mode)
    if mode == STANDARD:
        return StandardRandomizer(public_key)
    return FixedBaseRandomizer(public_key, mode=mode, private_key=private_key)


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
    backend: Backend,
    function: object,
    fixed_args: tuple[object, ...],
    count: int,
    *,
    sensitive: bool = False,
) -> list[mpz]:
    # A few chunks per worker, so that a worker slowed by a busy neighbour does not hold
    # the whole batch back (each chunk still takes milliseconds per value).
    parts = 1 if backend.parallelism == 1 else 4 * backend.parallelism
    parts = min(parts, max(1, count // _MIN_PARALLEL_CHUNK))
    if parts <= 1:
        return function(*fixed_args, count)  # type: ignore[operator]
    sizes = [stop - start for start, stop in chunk_bounds(count, parts)]
    arguments = [(*fixed_args, size) for size in sizes]
    chunks = backend.run(function, arguments, sensitive=sensitive)  # type: ignore[arg-type]
    return [mpz(value) for chunk in chunks for value in chunk]


class StandardRandomizer:
    """Textbook obfuscators r^n mod n^2, r uniform in Z_n^* (one full exponentiation each)."""

    mode = STANDARD

    def __init__(self, public_key: PaillierPublicKey) -> None:
        self._n = int(public_key.n)

    @property
    def n(self) -> int:
        return self._n

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        _check_count(count)
        return _parallel_generate(backend or SERIAL, standard_obfuscators, (self._n,), count)


class FixedBaseRandomizer:
    """h_s^r mod n^2 with a fixed-base window table: ``mode="full"`` (r < n, DCR only; the
    default) or ``mode="short"`` (r of ceil(k/2) bits). See the module docstring."""

    def __init__(
        self,
        public_key: PaillierPublicKey,
        *,
        mode: str = FULL,
        window_bits: int | None = None,
        private_key: PaillierPrivateKey | None = None,
    ) -> None:
        n = int(public_key.n)
        mode = randomizer_mode(mode)
        if mode == STANDARD:
            raise PaillierError("FixedBaseRandomizer takes mode 'full' or 'short'")
        if n % 4 != 1:
            raise PaillierError(
                "the fixed-base randomizer needs n = pq with p = q = 3 (mod 4); this modulus "
                "is not of that shape (n mod 4 != 1): use randomizer='standard'"
            )
        if window_bits is not None and not 1 <= window_bits <= 12:
            raise PaillierError(f"window_bits must be in [1, 12], got {window_bits}")
        self.mode = mode
        self._n = n
        self._window_bits = window_bits
        self._planned = 0
        self._factors: tuple[int, int] | None = None
        if private_key is not None:
            if int(private_key.public_key.n) != n:
                raise PaillierError("the private key does not belong to this public key")
            self._factors = (int(private_key.p), int(private_key.q))
        x = random_unit(n)
        h = (-(x * x)) % n
        self._h_s = int(gmpy2.powmod(h, n, mpz(n) * n))

    @property
    def n(self) -> int:
        return self._n

    @property
    def exponent_bits(self) -> int:
        """Length of the random exponent: k (full) or ceil(k/2) (short) for a k-bit n."""
        return self._n.bit_length() if self.mode == FULL else math.ceil(self._n.bit_length() / 2)

    def exponents(self, count: int) -> list[int]:
        """``count`` fresh exponents r of this mode (uniform below n, or of ceil(k/2) bits)."""
        if self.mode == FULL:
            return [secrets.randbelow(self._n) for _ in range(count)]
        bits = self.exponent_bits
        return [secrets.randbits(bits) for _ in range(count)]

    def plan(self, count: int) -> None:
        """Expect to draw about ``count`` values for this key in all (e.g. a whole job's).

        Only a hint for the table's window: a table otherwise starts small and is rebuilt
        larger as the process draws more; with the total known, the window that suits it is
        built once. The values are the same whatever the window."""
        _check_count(count)
        self._planned = max(self._planned, count)

    def _window(self, backend: Backend) -> int | None:
        """The window asked for, else the one that suits the planned draws: all of them where
        this process's threads share one table, each worker process's share otherwise
        (parallel calls only: a small call in this process keeps the window that suits it)."""
        if self._window_bits is not None or not self._planned or backend.parallelism <= 1:
            return self._window_bits
        share = 1 if isinstance(backend, ThreadBackend) else backend.parallelism
        return _window_for(-(-self._planned // share), self.exponent_bits)

    def power(self, exponents: Sequence[int]) -> list[mpz]:
        """h_s^r mod n^2 for given exponents (serially; the tests use it as the reference)."""
        return fixed_base_powers(self._n, self._h_s, self._factors, self._window_bits, exponents)

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        _check_count(count)
        # the kernel's products on this process's threads: one table for all of them
        backend = for_kernel(backend or SERIAL, native.preferred(mpz(self._n) * self._n))
        fixed = (self._n, self._h_s, self.mode, self._factors, self._window(backend))
        return _parallel_generate(
            backend,
            fixed_base_obfuscators,
            fixed,
            count,
            sensitive=self._factors is not None,
        )


def fixed_base_obfuscators(
    n: int,
    h_s: int,
    mode: str,
    factors: tuple[int, int] | None,
    window_bits: int | None,
    count: int,
) -> list[mpz]:
    """``count`` values h_s^r mod n^2 with fresh exponents of ``mode`` (runs in workers)."""
    if mode == FULL:
        exponents = [secrets.randbelow(n) for _ in range(count)]
    elif mode == SHORT:
        bits = math.ceil(n.bit_length() / 2)
        exponents = [secrets.randbits(bits) for _ in range(count)]
    else:
        raise PaillierError(f"unknown fixed-base mode {mode!r}")
    return fixed_base_powers(n, h_s, factors, window_bits, exponents)


def fixed_base_powers(
    n: int,
    h_s: int,
    factors: tuple[int, int] | None,
    window_bits: int | None,
    exponents: Sequence[int],
) -> list[mpz]:
    """h_s^e mod n^2 for each e; modulo p^2 and q^2 when the factors are given."""
    if factors is None:
        half = math.ceil(n.bit_length() / 2)
        longest = max((int(e).bit_length() for e in exponents), default=0)
        bits = half if longest <= half else max(n.bit_length(), longest)
        return _powers(mpz(n) * n, h_s, bits, window_bits, exponents)
    p, q = (mpz(f) for f in factors)
    p_square, q_square = p * p, q * q
    # h_s is an n-th power, so modulo p^2 its order divides p - 1 (same for q): exact.
    p_order, q_order = int(p - 1), int(q - 1)
    p_bits, q_bits = p_order.bit_length(), q_order.bit_length()
    mod_p = _powers(p_square, h_s % p_square, p_bits, window_bits, [e % p_order for e in exponents])
    mod_q = _powers(q_square, h_s % q_square, q_bits, window_bits, [e % q_order for e in exponents])
    recombine = gmpy2.invert(p_square, q_square)
    return [
        a + p_square * ((b - a) * recombine % q_square) for a, b in zip(mod_p, mod_q, strict=True)
    ]


_TABLES: dict[tuple[int, int, int], list[list[mpz | None]] | native.FixedBaseTable] = {}
_DRAWN: dict[tuple[int, int, int], int] = {}  # values this process computed per base so far
_TABLES_LOCK = threading.Lock()
_BUILDING: dict[tuple[int, int, int], threading.Lock] = {}  # one per table being built


def _window_for(values: int, bits: int, largest: int = DEFAULT_WINDOW_BITS) -> int:
    """The window that makes ``values`` powers cheapest, table included: a w-bit table costs
    ceil(bits/w) * 2^w multiplications to build and ceil(bits/w) per value."""
    windows = range(_MIN_WINDOW_BITS, max(largest, _MIN_WINDOW_BITS) + 1)
    return min(windows, key=lambda w: -(-bits // w) * ((1 << w) + values))


def _table_window(table: list[list[mpz | None]] | native.FixedBaseTable) -> int:
    if isinstance(table, native.FixedBaseTable):
        return table.window
    return (len(table[0]) - 1).bit_length()


def _chosen_window(
    table: list[list[mpz | None]] | native.FixedBaseTable | None,
    drawn: int,
    bits: int,
    window_bits: int | None,
) -> int | None:
    """The window to (re)build the table at, or None to keep the one there is.

    A fixed ``window_bits`` is kept as asked. Otherwise the table grows: the values drawn so
    far stand for those still to come, and a larger window is built only when their saving
    repays its table (so the tables built cost at most about what the values themselves do,
    and a job of a few thousand values never builds a 380 MB one)."""
    if window_bits is not None:
        return None if table is not None and _table_window(table) == window_bits else window_bits
    best = _window_for(drawn, bits)
    if table is None:
        return best
    current = _table_window(table)
    if best <= current:
        return None
    rows_now, rows_best = -(-bits // current), -(-bits // best)
    return best if rows_best << best < (rows_now - rows_best) * drawn else None


def _powers(
    modulus: mpz, base: int | mpz, bits: int, window_bits: int | None, exponents: Sequence[int]
) -> list[mpz]:
    key = (int(modulus), int(base), bits)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        drawn = _DRAWN[key] = _DRAWN.get(key, 0) + len(exponents)
        while len(_DRAWN) > 4 * _TABLE_CACHE_SIZE:
            oldest = next(iter(_DRAWN))
            del _DRAWN[oldest]
            _BUILDING.pop(oldest, None)
        building = _BUILDING.setdefault(key, threading.Lock())
    if table is None and len(exponents) < _TABLE_WORTH:
        # A table pays off only over many values; a few go through GMP's powmod directly.
        return list(gmpy2.powmod_exp_list(mpz(base), [mpz(e) for e in exponents], modulus))
    if _chosen_window(table, drawn, bits, window_bits) is not None:
        with building:  # threads sharing the table build it once, not each its own
            table = _TABLES.get(key)
            window = _chosen_window(table, drawn, bits, window_bits)
            if window is not None:
                table = _built_table(modulus, base, bits, window)
                with _TABLES_LOCK:
                    _TABLES.pop(key, None)
                    while len(_TABLES) >= _TABLE_CACHE_SIZE:
                        _TABLES.pop(next(iter(_TABLES)))
                    _TABLES[key] = table
    assert table is not None
    window = _table_window(table)
    digits = _window_digits(exponents, bits, window)
    if isinstance(table, native.FixedBaseTable):
        return table.products(digits)
    results = []
    for value_digits in digits.tolist():
        accumulator = None
        for row, digit in zip(table, value_digits, strict=True):
            if digit:
                entry = row[digit]
                accumulator = entry if accumulator is None else accumulator * entry % modulus
        results.append(mpz(1) if accumulator is None else accumulator)
    return results


def _built_table(
    modulus: mpz, base: int | mpz, bits: int, window: int
) -> list[list[mpz | None]] | native.FixedBaseTable:
    """One table per key: the C kernel's (Montgomery form, one block) where it is the faster
    path, else the mpz rows; never both. The kernel's is built on as many threads as the
    pool that draws from it has (its threads wait for the table meanwhile)."""
    if native.preferred(modulus):
        rows = -(-bits // window)
        threads = min(os.cpu_count() or 1, 64)
        return native.FixedBaseTable(modulus, base, rows, window, threads=threads)
    return _fixed_base_table(modulus, mpz(base), bits, window)


def _window_digits(exponents: Sequence[int], bits: int, window_bits: int) -> np.ndarray:
    """Base-2^w digits (least significant first) of every exponent, extracted by numpy:
    an int64 array of shape (len(exponents), ceil(bits / w))."""
    rows = -(-bits // window_bits)
    width = -(-bits // 8)
    if any(int(e) >> bits for e in exponents) or any(int(e) < 0 for e in exponents):
        raise PaillierError(f"exponents must lie in [0, 2^{bits})")
    raw = b"".join(int(e).to_bytes(width, "little") for e in exponents)
    bit_matrix = np.unpackbits(
        np.frombuffer(raw, dtype=np.uint8).reshape(len(exponents), width),
        axis=1,
        bitorder="little",
    )
    padded = np.zeros((len(exponents), rows * window_bits), dtype=np.int64)
    usable = min(bit_matrix.shape[1], rows * window_bits)
    padded[:, :usable] = bit_matrix[:, :usable]
    weights = np.left_shift(1, np.arange(window_bits, dtype=np.int64))
    return padded.reshape(len(exponents), rows, window_bits) @ weights


def _fixed_base_table(
    modulus: mpz, base: mpz, bits: int, window_bits: int
) -> list[list[mpz | None]]:
    """Row t holds [None, b_t, b_t^2, .., b_t^(2^w - 1)] with b_t = base^(2^(w t))."""
    rows = []
    for _ in range(-(-bits // window_bits)):
        row: list[mpz | None] = [None, base]
        power = base
        for _ in range((1 << window_bits) - 2):
            power = power * base % modulus
            row.append(power)
        rows.append(row)
        base = power * base % modulus
    return rows


class ObfuscatorPool:
    """Obfuscators computed ahead of need in memory, each handed out at most once.

    ``fill`` computes a batch (in parallel with a backend); ``start_background_fill`` keeps a
    daemon thread topping the pool up. When the pool runs dry, :meth:`obfuscators` computes the
    shortfall on demand rather than failing.
    """

    def __init__(self, source: Randomizer) -> None:
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

    def plan(self, count: int) -> None:
        """Pass the expected total draws on to a source that sizes its tables by it."""
        plan = getattr(self._source, "plan", None)
        if plan is not None:
            plan(count)

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        _check_count(count)
        with self._lock:
            taken = [self._values.popleft() for _ in range(min(count, len(self._values)))]
        shortfall = count - len(taken)
        if shortfall:
            self.computed_on_demand += shortfall
            taken.extend(self._source.obfuscators(shortfall, backend=backend))
        return taken


_FILE_MAGIC = b"PRIVREG-OBFUSCATORS-1\n"
_HEADER_SIZE = 128
_CONSUMED_OFFSET = 96  # 8-byte big-endian count of records already handed out


class ObfuscatorFile:
    """A pool of precomputed obfuscators on disk, for one public key and one mode.

    Fill it in idle time (between rounds or scheduled runs); :meth:`obfuscators` then hands
    values out, computing any shortfall on demand. The file is as secret as a key: it is
    created with mode 0600 in the party's own area, and opening a file that others may read
    is refused. Each call takes an exclusive ``flock``, advances the persistent "consumed"
    counter and fsyncs it *before* reading the claimed records, then overwrites them with
    zeros; a value is therefore never handed out twice, by concurrent processes or after a
    restart (a crash in between loses values, never repeats them).
    """

    def __init__(
        self, path: str | os.PathLike[str], source: StandardRandomizer | FixedBaseRandomizer
    ):
        self._path = Path(path)
        self._source = source
        self._record = (2 * source.n.bit_length() + 7) // 8
        self._header = self._make_header()
        self.computed_on_demand = 0
        with self._locked() as fd:
            if os.fstat(fd).st_size == 0:
                os.pwrite(fd, self._header + bytes(8) + bytes(_HEADER_SIZE - 104), 0)
                os.fsync(fd)
            elif os.pread(fd, _CONSUMED_OFFSET, 0) != self._header:
                raise PaillierError(
                    f"obfuscator pool {self._path} belongs to another key or randomizer mode"
                )

    @property
    def n(self) -> int:
        return self._source.n

    @property
    def path(self) -> Path:
        return self._path

    def _make_header(self) -> bytes:
        digest = hashlib.sha256(f"paillier:{self._source.n:x}".encode()).hexdigest()[:48].encode()
        mode = self._source.mode.encode().ljust(26, b" ")
        header = _FILE_MAGIC + digest + mode
        assert len(header) == _CONSUMED_OFFSET
        return header

    def _locked(self) -> _LockedFile:
        return _LockedFile(self._path)

    def available(self) -> int:
        """Values stored and not yet handed out."""
        with self._locked() as fd:
            return self._stored(fd) - self._consumed(fd)

    def fill(self, count: int, *, backend: Backend | None = None) -> None:
        """Compute ``count`` obfuscators now and append them to the file."""
        _check_count(count)
        values = self._source.obfuscators(count, backend=backend)
        data = b"".join(int(v).to_bytes(self._record, "big") for v in values)
        with self._locked() as fd:
            os.pwrite(fd, data, _HEADER_SIZE + self._stored(fd) * self._record)
            os.fsync(fd)

    def take(self, count: int) -> list[mpz]:
        """Up to ``count`` stored values, claimed durably before they are read."""
        _check_count(count)
        with self._locked() as fd:
            consumed = self._consumed(fd)
            claimed = min(count, self._stored(fd) - consumed)
            if claimed <= 0:
                return []
            os.pwrite(fd, (consumed + claimed).to_bytes(8, "big"), _CONSUMED_OFFSET)
            os.fsync(fd)
            offset = _HEADER_SIZE + consumed * self._record
            raw = os.pread(fd, claimed * self._record, offset)
            os.pwrite(fd, bytes(len(raw)), offset)
            os.fsync(fd)
        values = [
            mpz(int.from_bytes(raw[i : i + self._record], "big"))
            for i in range(0, len(raw), self._record)
        ]
        if any(v == 0 for v in values):
            raise PaillierError(f"obfuscator pool {self._path} holds consumed (zeroed) records")
        return values

    def obfuscators(self, count: int, *, backend: Backend | None = None) -> list[mpz]:
        taken = self.take(count)
        shortfall = count - len(taken)
        if shortfall:
            self.computed_on_demand += shortfall
            taken.extend(self._source.obfuscators(shortfall, backend=backend))
        return taken

    def _stored(self, fd: int) -> int:
        return (os.fstat(fd).st_size - _HEADER_SIZE) // self._record

    @staticmethod
    def _consumed(fd: int) -> int:
        return int.from_bytes(os.pread(fd, 8, _CONSUMED_OFFSET), "big")


POOL_SUFFIX = ".pool"


def pool_path(database: str | os.PathLike[str], n: int, mode: str) -> Path:
    """The pool file of the party owning ``database`` for key ``n`` and ``mode``:
    ``<database>.obfuscators/<fingerprint of n>.<mode>.pool``, next to its own store."""
    digest = hashlib.sha256(f"paillier:{int(n):x}".encode()).hexdigest()[:32]
    folder = Path(database).with_name(Path(database).name + ".obfuscators")
    return folder / f"{digest}.{randomizer_mode(mode)}{POOL_SUFFIX}"


def private_folder(folder: Path) -> Path:
    """``folder``, created at 0700 if missing; refused when others may enter it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.getuid():
        raise PaillierError(
            f"obfuscator folder {folder} is accessible to others (mode "
            f"{stat.filemode(info.st_mode)}); it holds secrets: chmod 700"
        )
    return folder


def discard_pool(path: Path) -> None:
    """Delete a pool whose key is retired (its values would never be used): zeroed first."""
    if not path.exists():
        return
    try:
        with _LockedFile(path) as fd:
            os.pwrite(fd, bytes(os.fstat(fd).st_size), 0)
            os.fsync(fd)
        path.unlink()
    except FileNotFoundError:
        return


class _LockedFile:
    """Open (creating with mode 0600), check the permissions, hold an exclusive flock."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = -1

    def __enter__(self) -> int:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            info = os.fstat(self._fd)
            if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.getuid():
                raise PaillierError(
                    f"obfuscator pool {self._path} is accessible to others (mode "
                    f"{stat.filemode(info.st_mode)}); it is as secret as a key: chmod 600"
                )
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self._fd)
            raise
        return self._fd

    def __exit__(self, *_exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise PaillierError(f"count must be a non-negative int, got {count!r}")
