"""Every product of the Montgomery kernel (IFMA, AVX2, portable C) at the sizes Paillier uses
(1024-, 2048- and 4096-bit moduli: n^2 of 512- to 2048-bit keys, p^2 of 1024- to 4096-bit
keys): known answers, edge residues and unreduced inputs against gmpy2 and Python's own
integers, the interleaved bucket method (two products in flight up to 3072 bits) against the
one-chain results, CRT decryption, the run-time dispatch forced through the environment,
and which product a process pool's workers run.
A path the CPU lacks is skipped with the reason (``kernel_path`` in test_paillier_native)."""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys

import gmpy2
import numpy as np
import pytest
from gmpy2 import mpz
from test_paillier_layer import naive_products
from test_paillier_native import ROOT, kernel_path  # noqa: F401  (the fixture)

from core.paillier import kernels, multiexp, native
from core.paillier.decryption import CrtDecryptor
from core.paillier.errors import PaillierError
from core.paillier.parallel import ProcessBackend

SIZES = (1024, 2048, 4096)


def _stream(label: str, bits: int) -> int:
    """``bits`` deterministic bits from SHA-256 (the known answers' inputs)."""
    out, k = b"", 0
    while len(out) * 8 < bits:
        out += hashlib.sha256(f"{label}:{k}".encode()).digest()
        k += 1
    return int.from_bytes(out, "little") & ((1 << bits) - 1)


def _kat_inputs(bits: int) -> tuple[int, int, int]:
    m = _stream("modulus", bits) | 1 | (1 << (bits - 1))
    return m, _stream("a", bits) % m, _stream("b", bits) % m


def _digest(value: int, bits: int) -> str:
    return hashlib.sha256(int(value).to_bytes(bits // 8, "little")).hexdigest()[:32]


# SHA-256 (first 128 bits) of a * b^1000 mod m and of a^(2^64) mod m, little-endian, for the
# inputs of _kat_inputs; computed once with Python's integers, independently of gmpy2.
KNOWN_ANSWERS = {
    1024: ("3b098a8d5f31d6b953ea560531c7f4fa", "70121d9ff6ae739e67ae8815d277acf7"),
    2048: ("2f17f1d860bc9c333d25c55ba16d296a", "bb24c18c287d6658cc55b88edeab3fc1"),
    4096: ("809d1a0dc03e8b6f7193dc98633aa297", "1eba650e6a3cd9d303bc117529a24195"),
}


@pytest.mark.parametrize("bits", SIZES)
def test_known_answers(bits: int, kernel_path: str) -> None:  # noqa: F811
    m, a, b = _kat_inputs(bits)
    product = native.multiply_chain(m, a, b, 1000)
    assert _digest(product, bits) == KNOWN_ANSWERS[bits][0]
    assert product == a * pow(b, 1000, m) % m
    assert native.multiply_chain(m, a, b, 500, pair=True) == a * pow(b, 500, m) % m
    square = native.multiply_chain(m, a, a, 64, square=True)
    assert _digest(square, bits) == KNOWN_ANSWERS[bits][1]
    assert square == pow(a, 2**64, m)


def _moduli(bits: int) -> list[mpz]:
    """A random odd modulus and one of nearly all-ones limbs (the lazy carries' worst case)."""
    dense = (mpz(1) << bits) - 1 - (mpz(1) << (bits // 3))
    return [mpz(secrets.randbits(bits)) | 1 | (mpz(1) << (bits - 1)), dense]


def _edge_values(m: mpz) -> list[int]:
    """0, 1, m - 1, a random residue, and unreduced inputs (m, m + 1, 2m - 1, 5m + r, -1,
    -m - 2), which the layer reduces first as the gmpy2 path would."""
    k = int(m)
    r = secrets.randbelow(k)
    return [0, 1, k - 1, r, k, k + 1, 2 * k - 1, 5 * k + r, -1, -k - 2]


@pytest.mark.parametrize("bits", SIZES)
def test_edge_and_unreduced_residues_equal_gmpy2(bits: int, kernel_path: str) -> None:  # noqa: F811
    for m in _moduli(bits):
        values = _edge_values(m)
        for a in values:
            for b in values:
                assert native.multiply_chain(m, a, b, 1) == mpz(a) * b % m
            assert native.multiply_chain(m, a, values[3], 2, pair=True) == (
                mpz(a) * gmpy2.powmod(values[3], 2, m) % m
            )
            assert native.multiply_chain(m, a, a, 3, square=True) == gmpy2.powmod(a, 8, m)
        exponent = secrets.randbits(bits // 2)
        assert native.powmod_many(values, exponent, m) == [
            gmpy2.powmod(v, exponent, m) for v in values
        ]
        table = native.FixedBaseTable(m, values[7], rows=4, window=3)  # unreduced base
        digits = np.array([[0, 0, 0, 0], [7, 7, 7, 7], [1, 0, 5, 2]], dtype=np.int64)
        assert table.products(digits) == [
            mpz(1),
            gmpy2.powmod(values[7], 2**12 - 1, m),
            gmpy2.powmod(values[7], 1 + 5 * 2**6 + 2 * 2**9, m),
        ]


def _column_with_runs(rows: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """Digits with runs of every length 1..9 (odd and even: the split chains' leftovers),
    gaps of 1 and more between the distinct digits, and zeros."""
    values: list[int] = []
    digit = (1 << window) - 1
    length = 1
    while len(values) < rows and digit > 0:
        values += [digit] * length
        length = length % 9 + 1
        digit -= int(rng.integers(1, 4))
    values += [0] * (rows - len(values))
    return rng.permutation(np.array(values[:rows], dtype=np.int64))


# 3072 bits is the largest modulus with two products in flight, 3584 the smallest without.
@pytest.mark.parametrize("bits", [1024, 2048, 3072, 3584, 4096])
def test_bucket_method_with_split_chains_equals_gmpy2(bits: int, kernel_path: str) -> None:  # noqa: F811
    rng = np.random.default_rng(bits)
    m = _moduli(bits)[0]
    rows = 90
    bases = [mpz(secrets.randbelow(int(m))) for _ in range(rows)]
    window = 5
    columns = [
        _column_with_runs(rows, window, rng),
        # two windows: each position's digits have runs of their own
        _column_with_runs(rows, window, rng) << window | _column_with_runs(rows, window, rng),
        np.full(rows, 3, dtype=np.int64),  # one run of every row
        np.concatenate([[31], np.zeros(rows - 1, dtype=np.int64)]),  # one row, one run
        np.concatenate([[31, 31, 31], np.zeros(rows - 3, dtype=np.int64)]),  # shortest split
        np.concatenate([[31, 30, 1], np.zeros(rows - 3, dtype=np.int64)]),  # runs of one
    ]
    exponents = np.ascontiguousarray(np.column_stack(columns).astype(np.int64))
    windows = np.full(exponents.shape[1], window, dtype=np.int64)
    got = native.dense_multiexp(bases, exponents, windows, m)
    expected = [
        multiexp._dense_column(bases, exponents[:, j], window, m) for j in range(len(columns))
    ]
    assert got == expected
    assert expected[2] == gmpy2.powmod(multiexp._product(bases, m), 3, m)


@pytest.mark.parametrize("bits", [2048, 4096])
def test_signed_columns_equal_the_plaintext_products(bits: int, kernel_path: str) -> None:  # noqa: F811
    # Negative exponents go through a bias: the kernel also returns the product of the bases
    # (one more column), whose inverse takes the bias out again.
    p = gmpy2.next_prime(mpz(secrets.randbits(bits // 2)) | (mpz(1) << (bits // 2 - 1)))
    m = p * p
    rng = np.random.default_rng(bits)
    rows = 40
    bases = [mpz(secrets.randbelow(int(m) - 2) + 2) for _ in range(rows)]
    exponents = np.column_stack(
        [
            rng.integers(-(2**18), 2**18, rows),
            rng.integers(0, 2**18, rows),  # no bias: the kernel's columns alone
            rng.integers(-(2**40), -(2**30), rows),  # all negative
        ]
    ).astype(np.int64)
    assert multiexp.multiexp_columns(bases, exponents, m) == naive_products(bases, exponents, m)
    with pytest.raises(PaillierError, match="not invertible"):
        multiexp.multiexp_columns([p * 5, *bases[1:]], exponents, m)


def test_crt_decryption_at_a_2048_bit_key_equals_the_formula(kernel_path: str) -> None:  # noqa: F811
    # p^2 and q^2 are 2048-bit moduli: CRT decryption's powers on the path's product.
    p, q = (gmpy2.next_prime(mpz(secrets.randbits(1024)) | (mpz(3) << 1022)) for _ in range(2))
    n = p * q
    n_square = n * n
    plain = [0, 1, int(n) - 1, *(secrets.randbelow(int(n)) for _ in range(5))]
    encrypted = [
        (1 + m * n) * gmpy2.powmod(secrets.randbelow(int(n) - 1) + 1, n, n_square) % n_square
        for m in plain
    ]
    assert CrtDecryptor(int(p), int(q)).decrypt_many(encrypted) == plain


def _path_in_subprocess(**env: str) -> subprocess.CompletedProcess:
    code = "from core.paillier import native; print(native.AVAILABLE, native.current_path())"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRIVREG_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
    )


def test_an_unknown_forced_path_fails_and_pure_python_wins_over_a_forced_one() -> None:
    # Forcing each path through the variable: test_paillier_native's forced-path test.
    if not native.AVAILABLE:
        pytest.skip("native kernel disabled")
    unknown = _path_in_subprocess(**{native.PATH_VARIABLE: "sse9"})
    assert unknown.returncode != 0 and "unknown Montgomery path" in unknown.stderr
    fastest = native.supported_paths()[0]
    pure = {native.PATH_VARIABLE: fastest, native.PURE_PYTHON_VARIABLE: "1"}
    assert _path_in_subprocess(**pure).stdout.strip() == "False None"


def test_ifma_is_refused_where_the_cpu_lacks_it() -> None:
    if not native.AVAILABLE:
        pytest.skip("native kernel disabled")
    if "ifma" in native.supported_paths():
        pytest.skip("this CPU has IFMA (the forced-path tests run it)")
    refused = _path_in_subprocess(**{native.PATH_VARIABLE: "ifma"})
    assert refused.returncode != 0 and "not available on this CPU" in refused.stderr


def test_workers_report_the_product_they_run() -> None:
    # Workers pick their product at import, from the CPU or the environment's forced path.
    expected = "gmpy2"
    if native.AVAILABLE:
        expected = os.environ.get(native.PATH_VARIABLE) or native.supported_paths()[0]
    previous = native.set_path("portable") if native.AVAILABLE else None
    try:
        assert kernels.montgomery_path() == ("portable" if native.AVAILABLE else "gmpy2")
        with ProcessBackend(max_workers=2) as backend:
            assert backend.run(kernels.montgomery_path, [(), ()]) == [expected, expected]
    finally:
        if previous is not None:
            native.set_path(previous)
