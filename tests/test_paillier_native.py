"""The native Montgomery kernel equals the gmpy2 reference bit for bit, rejects bad input with
ValueError, and the flows' API (encryption, X^T [[d]]) gives the plaintext results through it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import gmpy2
import numpy as np
import pytest
from gmpy2 import mpz
from test_paillier_layer import naive_products

from core.paillier import cipher, multiexp, native, randomness
from core.paillier.decryption import CrtDecryptor
from core.paillier.keys import generate_keypair

ROOT = Path(__file__).resolve().parents[1]
PURE_PYTHON = os.environ.get(native.PURE_PYTHON_VARIABLE) == "1"
needs_kernel = pytest.mark.skipif(not native.AVAILABLE, reason="native kernel disabled")


def _odd_moduli() -> dict[str, mpz]:
    """Odd moduli of the shapes the kernel meets: n^2 of 512- and 1024-bit keys (1024- and
    2048-bit moduli), CRT's p^2, and sizes that are not whole limbs."""
    sizes = (256, 256, 512, 512, 300)
    primes = [gmpy2.next_prime(mpz(secrets.randbits(b)) | (1 << (b - 1))) for b in sizes]
    return {
        "n^2 of a 512-bit key": (primes[0] * primes[1]) ** 2,
        "n^2 of a 1024-bit key": (primes[2] * primes[3]) ** 2,
        "p^2 (CRT)": primes[2] ** 2,
        "600-bit p^2, partial limb": primes[4] ** 2,
        "65-bit": mpz(2**64 + 13),
        "one limb": mpz(0xFFFFFFFFFFFFFFC5),
        "4096-bit (n^4), 64 limbs": (primes[2] * primes[3]) ** 4,
    }


MODULI = _odd_moduli()


def _run(code: str, **env: str) -> str:
    """``code`` in a fresh interpreter (the kernel's path is fixed at import)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_the_kernel_is_built_unless_pure_python_is_asked_for() -> None:
    # The suite runs where gcc is present, so an unbuilt extension is a broken install.
    assert native.AVAILABLE is (not PURE_PYTHON)
    code = "from core.paillier import native; print(native.AVAILABLE, native.current_path())"
    assert _run(code, **{native.PURE_PYTHON_VARIABLE: "1"}) == "False None"


ROUND_TRIP = """
import numpy as np
from core.paillier import cipher, native
from core.paillier.keys import generate_keypair
public, private = generate_keypair(512, allow_insecure_key_size=True)
values = [0, 1, -1, 2**100, *range(40)]
X = np.arange(len(values) * 3, dtype=np.int64).reshape(len(values), 3) - 50
encrypted = cipher.encrypt(public, values)
assert cipher.decrypt(private, encrypted) == values
dot = cipher.decrypt(private, cipher.transpose_dot(public, X, encrypted))
assert dot == [sum(int(x) * v for x, v in zip(X[:, j], values)) for j in range(3)]
print(native.AVAILABLE, native.current_path())
"""


def test_an_install_without_the_extension_runs_on_gmpy2() -> None:
    # What a machine without a C compiler gets: setup.py's optional extension is skipped and
    # the import fails; the layer must then encrypt, decrypt and multiply on gmpy2 alone.
    blocker = (
        "import sys\n"
        "class NoKernel:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'core.paillier._montgomery':\n"
        "            raise ImportError('not built')\n"
        "sys.meta_path.insert(0, NoKernel())\n"
    )
    assert _run(blocker + ROUND_TRIP) == "False None"


def test_a_build_without_a_compiler_completes_and_builds_nothing(tmp_path: Path) -> None:
    # setup.py's extension with a compiler that always fails: the build step must warn and
    # finish (what lets pip install the package), leaving no module behind.
    code = (
        "import runpy, setuptools\n"
        "kw = {}\n"
        "setuptools.setup = lambda **k: kw.update(k)\n"
        "runpy.run_path('setup.py')\n"
        "dist = setuptools.Distribution({'name': 'probe', 'ext_modules': kw['ext_modules']})\n"
        "command = dist.get_command_obj('build_ext')\n"
        f"command.build_lib, command.build_temp = {str(tmp_path / 'lib')!r}, "
        f"{str(tmp_path / 'tmp')!r}\n"
        "command.ensure_finalized()\n"
        "command.run()\n"
        "print('finished')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "CC": "false", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "finished"
    assert "failed" in result.stderr + result.stdout
    assert not list(tmp_path.rglob("*.so"))


def test_setup_keeps_the_extension_optional_and_portable() -> None:
    # optional=True: a failed compile does not fail the install; no -march: one wheel runs on
    # CPUs without AVX2 or IFMA (those paths are chosen at run time).
    captured = _run(
        "import runpy, setuptools\n"
        "setuptools.setup = lambda **kw: print([(e.name, e.optional, e.extra_compile_args)"
        " for e in kw['ext_modules']])\n"
        "runpy.run_path('setup.py')",
    )
    assert "('core.paillier._montgomery', True," in captured
    assert "march" not in captured


def test_each_forced_path_is_taken_or_refused(kernel_path: str) -> None:
    code = ROUND_TRIP
    assert _run(code, **{native.PATH_VARIABLE: kernel_path}) == f"True {kernel_path}"
    assert native.current_path() == kernel_path
    with pytest.raises(ValueError, match="unknown"):
        native.set_path("sse2")


def test_the_default_path_is_the_fastest_the_cpu_has() -> None:
    if not native.AVAILABLE:
        pytest.skip("native kernel disabled")
    env = {k: v for k, v in os.environ.items() if k != native.PATH_VARIABLE}
    default = subprocess.run(
        [sys.executable, "-c", "from core.paillier import native; print(native.current_path())"],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert default == native.supported_paths()[0]
    assert "portable" in native.supported_paths()
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        flags = Path("/proc/cpuinfo").read_text().split()
        assert ("ifma" in native.supported_paths()) is ("avx512ifma" in flags)
        assert ("avx2" in native.supported_paths()) is ("avx2" in flags)


@pytest.fixture(params=["ifma", "avx2", "portable"])
def kernel_path(request):
    """Run a test on each product (skipped, with the reason, where the CPU lacks it)."""
    if not native.AVAILABLE:
        pytest.skip("native kernel disabled")
    if request.param not in native.supported_paths():
        pytest.skip(f"this CPU cannot run the {request.param} product")
    previous = native.set_path(request.param)
    try:
        yield request.param
    finally:
        native.set_path(previous)


def test_flows_use_the_kernel_only_where_it_measured_faster(kernel_path: str) -> None:
    assert native.preferred(MODULI["n^2 of a 1024-bit key"])
    assert native.preferred(MODULI["p^2 (CRT)"])
    big = mpz(1) << (native.NATIVE_MAX_BITS + 1) | 1
    assert native.preferred(big) is (kernel_path != "portable")
    assert native.fixed_exponent_preferred() is (kernel_path == "ifma")


@pytest.mark.parametrize("name", MODULI)
def test_montgomery_products_and_squares_equal_gmpy2(name: str, kernel_path: str) -> None:
    m = MODULI[name]
    values = [mpz(0), mpz(1), m - 1, mpz(secrets.randbelow(int(m))), mpz(secrets.randbelow(int(m)))]
    for a in values:
        for b in values:
            for count in (0, 1, 7):
                assert native.multiply_chain(m, a, b, count) == a * gmpy2.powmod(b, count, m) % m
        assert native.multiply_chain(m, a, a, 5, square=True) == gmpy2.powmod(a, 32, m)
        assert native.multiply_chain(m, a, values[3], 3, pair=True) == (
            a * gmpy2.powmod(values[3], 3, m) % m
        )
    # unreduced and negative inputs are reduced first, like the gmpy2 path's results
    assert native.multiply_chain(m, m + 2, -1, 1) == (-2) % m


@pytest.mark.parametrize("bits", [1024, 2048, 4096, 8320, 8400])
def test_products_at_every_accumulator_size_equal_gmpy2(bits: int, kernel_path: str) -> None:
    # 8320 bits is the largest modulus the IFMA product holds in registers; 8400 falls back
    # to the next product. Moduli with all-ones limbs stress the lazy carries.
    dense = (mpz(1) << bits) - 1 - 2 * (mpz(1) << (bits // 2))
    for m in (dense, mpz(secrets.randbits(bits)) | 1 | (mpz(1) << (bits - 1))):
        for a, b in ((m - 1, m - 1), (m - 2, mpz(1)), (mpz(secrets.randbelow(int(m))), m - 1)):
            assert native.multiply_chain(m, a, b, 3) == a * gmpy2.powmod(b, 3, m) % m
            assert native.multiply_chain(m, a, b, 2, pair=True) == a * b * b % m
            assert native.multiply_chain(m, a, a, 2, square=True) == gmpy2.powmod(a, 4, m)


def test_fixed_exponent_powers_equal_gmpy2(kernel_path: str) -> None:
    for bits in (512, 1024, 2048):  # p^2 of 1024-, 2048- and 4096-bit keys
        p = gmpy2.next_prime(mpz(secrets.randbits(bits // 2)) | (mpz(1) << (bits // 2 - 1)))
        m = p * p
        bases = [mpz(0), mpz(1), m - 1, *(mpz(secrets.randbelow(int(m))) for _ in range(6))]
        for exponent in (0, 1, 31, 32, p - 1, secrets.randbits(bits)):
            expected = gmpy2.powmod_base_list(bases, exponent, m)
            assert native.powmod_many(bases, exponent, m) == expected
            assert native.powmod_many(bases[:3], exponent, m) == expected[:3]  # odd count
        assert native.powmod_many([m + 5, -3], p - 1, m) == [
            gmpy2.powmod(5, p - 1, m),
            gmpy2.powmod(-3, p - 1, m),
        ]
        assert native.powmod_many([], p - 1, m) == []


def test_crt_decryption_equals_gmpy2_on_every_path(kernel_path: str) -> None:
    public, private = generate_keypair(1024, allow_insecure_key_size=True)
    decryptor = CrtDecryptor.from_private_key(private)
    plain = [0, 1, int(public.n) - 1, *(secrets.randbelow(int(public.n)) for _ in range(9))]
    encrypted = cipher.encrypt(public, plain)
    assert decryptor.decrypt_many(encrypted) == plain
    signed = [v - public.n if v > public.n // 2 else v for v in plain]
    assert cipher.decrypt(private, encrypted) == signed


@pytest.mark.parametrize("name", MODULI)
def test_dense_multiexp_equals_the_gmpy2_reference(name: str, kernel_path: str) -> None:
    m = MODULI[name]
    rng = np.random.default_rng(len(name))
    rows = 37
    bases = [mpz(secrets.randbelow(int(m))) for _ in range(rows)]
    exponents = np.column_stack(
        [
            rng.integers(0, 2**20, rows),  # feature-like
            np.zeros(rows, dtype=np.int64),  # zero column: empty product
            np.ones(rows, dtype=np.int64),
            np.full(rows, 2**63 - 1, dtype=np.int64),  # largest int64
            rng.integers(0, 2**62, rows),
            np.where(rng.random(rows) < 0.2, rng.integers(1, 40, rows), 0),  # sparse
        ]
    ).astype(np.int64)
    for window_of in (lambda bits: multiexp.dense_window(rows, bits), lambda bits: 1, lambda _: 18):
        windows = [window_of(max(int(c.max()).bit_length(), 1)) for c in exponents.T]
        got = native.dense_multiexp(bases, exponents, np.array(windows, dtype=np.int64), m)
        reference = [
            multiexp._dense_column(bases, exponents[:, j], w, m) for j, w in enumerate(windows)
        ]
        assert got == reference
    single = native.dense_multiexp(bases[:1], exponents[:1], np.ones(6, dtype=np.int64), m)
    assert single == [gmpy2.powmod(bases[0], int(e), m) for e in exponents[0]]


def test_signed_columns_through_the_bias_path_equal_native_off(monkeypatch) -> None:
    m = MODULI["n^2 of a 1024-bit key"]  # units: the bias path inverts the product of bases
    rng = np.random.default_rng(7)
    rows = 64
    bases = [mpz(secrets.randbelow(int(m) - 1) + 1) for _ in range(rows)]
    exponents = np.column_stack(
        [
            rng.integers(-(2**23), 2**23, rows),
            rng.integers(-(2**61), 2**61, rows),
            rng.integers(0, 2**30, rows),
            np.where(rng.random(rows) < 0.05, 3, 0),  # sparse: the planner, not the kernel
        ]
    ).astype(np.int64)
    expected = naive_products(bases, exponents, m)
    fast = multiexp.multiexp_columns(bases, exponents, m)
    monkeypatch.setattr(native, "AVAILABLE", False)
    reference = multiexp.multiexp_columns(bases, exponents, m)
    assert fast == reference == expected


TABLE_MODULI = ["p^2 (CRT)", "600-bit p^2, partial limb", "65-bit", "4096-bit (n^4), 64 limbs"]


@pytest.mark.parametrize("name", TABLE_MODULI)
def test_fixed_base_products_equal_powmod(name: str, kernel_path: str) -> None:
    m = MODULI[name]
    base = mpz(secrets.randbelow(int(m)))
    bits, window = 130, 5  # 26 rows; 130 is not a multiple of 64 or of the window
    rows = -(-bits // window)
    table = native.FixedBaseTable(m, base, rows, window)
    exponents = [0, 1, 2**bits - 1, *(secrets.randbits(bits) for _ in range(20))]
    digits = randomness._window_digits(exponents, bits, window)
    assert table.products(digits) == [gmpy2.powmod(base, e, m) for e in exponents]
    assert table.nbytes == rows * 32 * 8 * -(-int(m).bit_length() // 64)


@pytest.mark.parametrize("name", TABLE_MODULI)
def test_a_table_built_on_several_threads_equals_the_one_thread_build(
    name: str, kernel_path: str
) -> None:
    """Each thread starts its share of the rows from row 0's base by squarings: every entry
    must equal the one-thread build's, for any split (more threads than rows included)."""
    m = MODULI[name]
    base = mpz(secrets.randbelow(int(m)))
    window, rows = 4, 11
    exponents = [
        0,
        1,
        2 ** (window * rows) - 1,
        *(secrets.randbits(window * rows) for _ in range(9)),
    ]
    digits = randomness._window_digits(exponents, window * rows, window)
    expected = [gmpy2.powmod(base, e, m) for e in exponents]
    for threads in (1, 2, 3, 11, 64):
        table = native.FixedBaseTable(m, base, rows, window, threads=threads)
        assert table.products(digits) == expected, threads
    for threads in (0, 65):
        with pytest.raises(ValueError, match="threads must be in"):
            native.FixedBaseTable(m, base, rows, window, threads=threads)


def test_table_path_equals_the_gmpy2_table_and_every_mode_decrypts(monkeypatch) -> None:
    public, private = generate_keypair(512, allow_insecure_key_size=True)
    m, h = mpz(public.nsquare), mpz(secrets.randbelow(public.nsquare))
    exponents = [secrets.randbits(300) for _ in range(randomness._TABLE_WORTH + 5)]
    randomness._TABLES.clear()
    fast = randomness._powers(m, h, 300, 11, exponents)
    kinds = {type(t) for t in randomness._TABLES.values()}
    monkeypatch.setattr(native, "AVAILABLE", False)
    randomness._TABLES.clear()
    assert randomness._powers(m, h, 300, 11, exponents) == fast
    assert fast == [gmpy2.powmod(h, e, m) for e in exponents]
    # one table per key, of the kind the process uses
    assert kinds == ({native.FixedBaseTable} if not PURE_PYTHON else {list})
    monkeypatch.undo()
    randomness._TABLES.clear()
    values = [0, 1, -1, 2**100, -(2**100), *range(60)]
    for mode in ("full", "short", "standard"):
        for own_key in (None, private):
            encrypted = cipher.encrypt(public, values, mode, private=own_key)
            assert cipher.decrypt(private, encrypted) == values
    randomness._TABLES.clear()


def test_transpose_dot_equals_the_plaintext_product() -> None:
    public, private = generate_keypair(512, allow_insecure_key_size=True)
    rng = np.random.default_rng(3)
    rows = 200
    X = np.column_stack(
        [
            rng.integers(-(2**20), 2**20, rows),  # signed features: bias path
            rng.integers(0, 2**16, rows),
            rng.integers(0, 2, rows),  # binary: planner
            np.zeros(rows, dtype=np.int64),
        ]
    ).astype(np.int64)
    d = rng.integers(-(2**40), 2**40, rows).tolist()
    encrypted = cipher.encrypt(public, d, private=private)
    result = cipher.decrypt(private, cipher.transpose_dot(public, X, encrypted))
    assert result == [sum(int(x) * v for x, v in zip(X[:, j], d, strict=True)) for j in range(4)]


@needs_kernel
def test_interleaving_is_reported_per_path_and_size() -> None:
    """Up to 3072 bits the IFMA loops always run two products interleaved, other paths never;
    above, IFMA's answer is a timing on this CPU, the same for the same size in a process."""
    big = MODULI["4096-bit (n^4), 64 limbs"]
    for path in native.supported_paths():
        previous = native.set_path(path)
        try:
            assert native.interleaves(MODULI["p^2 (CRT)"]) == (path == "ifma")
            assert native.interleaves(big) == native.interleaves(big)
            if path != "ifma":
                assert not native.interleaves(big)
        finally:
            native.set_path(previous)


@needs_kernel
def test_transpose_dot_runs_on_threads_where_the_kernel_does_it(monkeypatch) -> None:
    """Given worker processes, X^T [[d]] on the kernel runs on this process's threads (the
    kernel releases the GIL; nothing is shipped), by columns and by row blocks, exactly."""
    from core.paillier.parallel import ProcessBackend

    public, private = generate_keypair(1024, allow_insecure_key_size=True)
    backend = ProcessBackend(2)
    monkeypatch.setattr(cipher, "_parallel_backend", backend)
    rng = np.random.default_rng(5)
    rows = 2100  # enough work for the backend with one column
    d = rng.integers(-(2**30), 2**30, rows).tolist()
    encrypted = cipher.encrypt(public, d, private=private)
    for columns in (6, 1):  # whole columns per thread; row blocks multiplied together
        X = rng.integers(-(2**12), 2**12, (rows, columns)).astype(np.int64)
        result = cipher.decrypt(private, cipher.transpose_dot(public, X, encrypted))
        assert result == [int(np.dot(X[:, j].astype(object), d)) for j in range(columns)]
    assert backend._executor is None


@needs_kernel
def test_bad_input_is_refused_with_value_error(kernel_path: str) -> None:
    # On every path: contexts, tables and powers are built on the current path's product.
    kernel = native._kernel
    m = int(MODULI["p^2 (CRT)"])
    width = native._width(m)
    mod = m.to_bytes(width, "little")
    bases = native._pack([2, 3], m, width)
    good = np.array([[1, 2], [3, 4]], dtype=np.int64)
    windows = np.array([2, 2], dtype=np.int64)
    big = (m + 2).to_bytes(width, "little")
    assert kernel.dense_multiexp(mod, bases, good, windows)
    cases = {
        "even modulus": (((m + 1).to_bytes(width, "little")), bases, good, windows),
        "modulus length": (mod[:-3], bases, good, windows),
        "empty modulus": (b"", bases, good, windows),
        "bases length": (mod, bases[:-1], good, windows),
        "base above modulus": (mod, bases[:width] + big, good, windows),
        "rows": (mod, bases, good[:1], windows),
        "negative exponent": (mod, bases, -good, windows),
        "int32": (mod, bases, good.astype(np.int32), windows),
        "not contiguous": (mod, bases, np.asfortranarray(good), windows),
        "one dimension": (mod, bases, good.ravel(), windows),
        "window count": (mod, bases, good, windows[:1]),
        "window size": (mod, bases, good, np.array([0, 19], dtype=np.int64)),
    }
    for name, arguments in cases.items():
        with pytest.raises(ValueError):
            kernel.dense_multiexp(*arguments)
            pytest.fail(f"accepted: {name}")
    table = native.FixedBaseTable(m, 5, 3, 4)
    for digits in (
        np.array([[1, 2]], dtype=np.int64),  # rows
        np.array([[1, 2, 16]], dtype=np.int64),  # digit >= 2^window
        np.array([[1, -2, 3]], dtype=np.int64),
        np.array([[1, 2, 3]], dtype=np.int32),
    ):
        with pytest.raises(ValueError):
            kernel.fixed_base_products(table._table, digits)
    with pytest.raises(ValueError, match="fixed_base_table"):
        kernel.fixed_base_products(object(), np.zeros((1, 3), dtype=np.int64))
    with pytest.raises(ValueError):
        kernel.fixed_base_table(mod, native._pack([5], m, width), 3, 17)
    with pytest.raises(ValueError):
        kernel.mul_chain(b"\x01" * (8 * 257), b"", b"", 1, False)  # above the limb limit
    exponent = (12345).to_bytes(8, "little")
    assert kernel.powmod_fixed(mod, bases, exponent)
    for arguments in (
        ((m + 1).to_bytes(width, "little"), bases, exponent),  # even modulus
        (mod, bases[:-1], exponent),  # not whole values
        (mod, bases[:width] + big, exponent),  # base above the modulus
        (mod, bases, exponent[:5]),  # not whole limbs
        (mod, bases, b"\x01" * (8 * 257)),  # exponent above the limb limit
    ):
        with pytest.raises(ValueError):
            kernel.powmod_fixed(*arguments)
    with pytest.raises(ValueError):
        native.powmod_many([2], -1, m)
    with pytest.raises(ValueError, match="unknown"):
        kernel.product_path("neon")
