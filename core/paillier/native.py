"""The optional C kernel (``core.paillier._montgomery``) behind X^T [[d]] and fixed-base tables.

Why: both hot loops are long chains of multiplications modulo n^2 (or p^2, q^2). From Python
each step of such a chain allocates a gmpy2 ``mpz`` and reduces with GMP's division; the C
kernel keeps the operands in Montgomery form and runs a whole chain without the interpreter
and with the GIL released. Its product is chosen at run time from the CPU's features: AVX-512
IFMA (radix 2^52, eight 52x52-bit multiply-adds per instruction), else AVX2 (radix 2^26, four
32x32-bit products per instruction), else portable C (Karatsuba and a product-scanning
reduction); ``PRIVREG_MONTGOMERY_PATH`` or :func:`set_path` forces one.
``benchmarks/bench_paillier.py`` prints the ratios per multiplication and per operation. The
algorithms are the ones of :mod:`.multiexp` (bucket method, window from
:func:`.multiexp.dense_window`) and :mod:`.randomness` (fixed-base window table, digits from
its ``_window_digits``); only the arithmetic moves to C.

CRT decryption's powers (one exponent, many bases) run here too on the IFMA path only
(:func:`powmod_many`), where they measured about 3x GMP; elsewhere gmpy2 keeps them.

The extension is built by ``pip install -e .`` where a C compiler is present; without it (or
with ``PRIVREG_PURE_PYTHON=1`` in the environment, which keeps the fallback testable) the
gmpy2 code runs unchanged and gives the same results bit for bit.

Security: as in the gmpy2 code, bucket indices and table lookups depend on the secret
digits of exponents (obfuscator exponents, the host's features, and in decryption p - 1 and
q - 1, as in GMP's powmod), and a Montgomery product's
final subtraction is conditional. Nothing is constant-time: a process sharing this machine's
caches or timing it closely could learn about those digits. Remote peers see only total
running times, as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import gmpy2
import numpy as np
from gmpy2 import mpz

PURE_PYTHON_VARIABLE = "PRIVREG_PURE_PYTHON"
PATH_VARIABLE = "PRIVREG_MONTGOMERY_PATH"
"""Forces the kernel's product (``ifma``, ``avx2`` or ``portable``) for tests and benchmarks;
unset, the kernel takes the fastest the CPU has. A path the CPU lacks is an error at import,
not a silent fallback, so a benchmark never reports one path under another's name."""

PATHS = ("ifma", "avx2", "portable")

_kernel = None
if os.environ.get(PURE_PYTHON_VARIABLE, "") not in ("1", "true", "yes"):
    try:
        from core.paillier import _montgomery as _kernel
    except ImportError:  # not built (no compiler at install time): the gmpy2 path runs
        _kernel = None

AVAILABLE: bool = _kernel is not None
"""Whether the C kernel is importable and enabled in this process."""

NATIVE_MAX_BITS = 2048
"""Largest modulus the flows send to the kernel's portable (scalar) product. Measured side by
side on a two-core x86-64 machine (``make bench-paillier``): up to 2048-bit moduli (n^2 of
1024-bit keys; p^2, q^2 of 2048-bit keys) it wins end to end (no interpreter step per
multiplication); at 4096 bits GMP's assembly Karatsuba/Toom product and division are ~10%
faster than portable C, both bound by the 64x64-bit multiplier, so the gmpy2 path stays
there. Where the CPU has AVX2 or IFMA the kernel's vector product is faster than GMP at every
size and this limit does not apply."""


def supported_paths() -> tuple[str, ...]:
    """The products this build can run on this CPU, fastest first (empty without the kernel)."""
    if _kernel is None:
        return ()
    return tuple(name for name in PATHS if name in _kernel.supported_paths())


def current_path() -> str | None:
    """The product new work uses in this process (None when the gmpy2 code runs)."""
    return _kernel.product_path() if _kernel is not None else None


def set_path(name: str) -> str:
    """Use product ``name`` from now on in this process; returns the previous one.

    Raises ValueError for an unknown name or one this CPU cannot run (tests skip on it)."""
    _require()
    if name not in PATHS:
        raise ValueError(f"unknown Montgomery path {name!r}: one of {', '.join(PATHS)}")
    return _kernel.product_path(name)


def interleaves(modulus: int | mpz) -> bool:
    """Whether the kernel's loops (lookups, bucket chains, CRT powers) run two products modulo
    ``modulus`` interleaved on the current path: up to 3072 bits on IFMA, above where a timing
    at first use found the pair faster on this CPU. For benchmarks and logs."""
    _require()
    modulus = int(modulus)
    return bool(_kernel.interleaves(modulus.to_bytes(_width(modulus), "little")))


def vector_path() -> bool:
    """Whether the kernel uses a vector product (AVX2 or IFMA) in this process."""
    return AVAILABLE and current_path() in ("avx2", "ifma")


def preferred(modulus: int | mpz) -> bool:
    """Whether work modulo ``modulus`` should run in the kernel: built, enabled, and either
    the vector product or a modulus in the range where the scalar one measured faster."""
    if not AVAILABLE:
        return False
    return vector_path() or int(modulus).bit_length() <= NATIVE_MAX_BITS


def fixed_exponent_preferred() -> bool:
    """Whether CRT decryption's powers (one k/2-bit exponent, many bases) should run in the
    kernel: on the IFMA product only. Measured on the same machine (``make bench-paillier``),
    AVX2 and portable C lost to GMP's powmod there by 15-30%."""
    return AVAILABLE and current_path() == "ifma"


def _width(modulus: int) -> int:
    """Bytes per residue: whole 64-bit limbs, as the kernel reads them."""
    return 8 * -(-int(modulus).bit_length() // 64)


def _pack(values: Sequence[int | mpz], modulus: int, width: int) -> bytes:
    """Little-endian residues of ``width`` bytes; values outside [0, m) are reduced first
    (the gmpy2 path accepts them too, and its results are the same residues)."""
    packed = []
    for value in values:
        value = int(value)
        if not 0 <= value < modulus:
            value %= modulus
        packed.append(value.to_bytes(width, "little"))
    return b"".join(packed)


def _unpack(raw: bytes, width: int) -> list[mpz]:
    return [mpz(int.from_bytes(raw[i : i + width], "little")) for i in range(0, len(raw), width)]


def _require() -> None:
    if _kernel is None:
        raise RuntimeError("the native Montgomery kernel is not available in this process")


def dense_multiexp(
    bases: Sequence[int | mpz], exponents: np.ndarray, windows: np.ndarray, modulus: int | mpz
) -> list[mpz]:
    """prod_i bases[i]^exponents[i, j] mod ``modulus`` for every column j.

    ``exponents``: non-negative int64 (rows x cols); ``windows``: the bucket window of each
    column (int64). The kernel rejects negative exponents, wrong shapes and even moduli with
    ValueError; callers shift signed columns by a bias first (see :mod:`.multiexp`).
    """
    _require()
    modulus = int(modulus)
    width = _width(modulus)
    raw = _kernel.dense_multiexp(
        modulus.to_bytes(width, "little"),
        _pack(bases, modulus, width),
        exponents,
        windows,
    )
    return _unpack(raw, width)


class FixedBaseTable:
    """Window table of one fixed base modulo one modulus, held by the kernel in Montgomery
    form in one contiguous block (``rows * 2^window`` residues), opaque to Python."""

    def __init__(
        self, modulus: int | mpz, base: int | mpz, rows: int, window: int, threads: int = 1
    ) -> None:
        """``threads`` share the rows of the build (the entries do not depend on it)."""
        _require()
        self.modulus = int(modulus)
        self.rows = rows
        self.window = window
        self._width = _width(self.modulus)
        self._table = _kernel.fixed_base_table(
            self.modulus.to_bytes(self._width, "little"),
            _pack([base], self.modulus, self._width),
            rows,
            window,
            threads,
        )

    @property
    def nbytes(self) -> int:
        """Memory the table holds."""
        return self.rows * (1 << self.window) * self._width

    def products(self, digits: np.ndarray) -> list[mpz]:
        """For every row of ``digits`` (values x rows, int64, each in [0, 2^window)):
        prod_t table[t][digits[., t]], i.e. base^e for the exponent with those digits."""
        raw = _kernel.fixed_base_products(self._table, np.ascontiguousarray(digits))
        return _unpack(raw, self._width)


def multiply_chain(
    modulus: int | mpz,
    a: int | mpz,
    b: int | mpz,
    count: int,
    *,
    square: bool = False,
    pair: bool = False,
) -> mpz:
    """a * b^count (or a^(2^count) with ``square``) by ``count`` Montgomery products in one C
    loop: what the tests check the arithmetic with and the benchmark times it by. ``pair``
    runs two such chains through the two-way interleaved product (IFMA; two plain products
    elsewhere), which is how table lookups and decryption use it."""
    _require()
    modulus = int(modulus)
    width = _width(modulus)
    raw = _kernel.mul_chain(
        modulus.to_bytes(width, "little"),
        _pack([a], modulus, width),
        _pack([b], modulus, width),
        count,
        square,
        pair,
    )
    return _unpack(raw, width)[0]


def fixed_exponent_powers(
    bases: Sequence[int | mpz], exponent: int | mpz, modulus: int | mpz
) -> list[mpz]:
    """bases[i]^exponent mod ``modulus``, one exponent for many bases (CRT decryption's lifts,
    the packing of masked gradients): the kernel's IFMA product where this process uses it
    (about 3x GMP at 2048-bit keys, ``make bench-paillier``); otherwise gmpy2's
    powmod_base_list, which runs the batch in C and beat the AVX2 and portable products."""
    if fixed_exponent_preferred():
        return powmod_many(bases, exponent, modulus)
    return gmpy2.powmod_base_list([mpz(b) for b in bases], mpz(exponent), mpz(modulus))


def powmod_many(bases: Sequence[int | mpz], exponent: int | mpz, modulus: int | mpz) -> list[mpz]:
    """bases[i]^exponent mod ``modulus`` for every base: CRT decryption's shape (one exponent,
    p - 1, for a batch of ciphertexts), two bases in lockstep per pass."""
    _require()
    modulus, exponent = int(modulus), int(exponent)
    if exponent < 0:
        raise ValueError("exponent must be non-negative")
    width = _width(modulus)
    raw = _kernel.powmod_fixed(
        modulus.to_bytes(width, "little"),
        _pack(bases, modulus, width),
        exponent.to_bytes(8 * max(1, -(-exponent.bit_length() // 64)), "little"),
    )
    return _unpack(raw, width)


if _kernel is not None and os.environ.get(PATH_VARIABLE):
    set_path(os.environ[PATH_VARIABLE])
