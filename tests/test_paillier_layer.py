"""Keys, phe compatibility, multi-exponentiation and the process pool of the Paillier layer."""

from __future__ import annotations

import json
import math
import multiprocessing
import secrets

import gmpy2
import numpy as np
import pytest
from gmpy2 import mpz
from phe import paillier

from core.paillier import (
    KeyFormatError,
    KeySizeError,
    ProcessBackend,
    cipher,
    generate_keypair,
    multiexp_columns,
    native,
    private_key_from_dict,
    private_key_to_dict,
    public_key_from_dict,
    public_key_to_dict,
)
from core.paillier.decryption import CrtDecryptor
from core.paillier.multiexp import plan_column
from core.paillier.parallel import chunk_bounds

TEST_KEY_BITS = 1024


@pytest.fixture(scope="module")
def keypair():
    return generate_keypair(TEST_KEY_BITS, allow_insecure_key_size=True)


@pytest.fixture()
def rng():
    return np.random.default_rng(secrets.randbits(32))


# ---------------------------------------------------------------------------- keys


def test_default_key_is_2048_bits_and_short_keys_need_the_flag():
    public_key, private_key = generate_keypair()
    assert public_key.n.bit_length() == 2048
    assert private_key.p * private_key.q == public_key.n
    with pytest.raises(KeySizeError, match="allow_insecure_key_size"):
        generate_keypair(1024)
    with pytest.raises(KeySizeError, match="even"):
        generate_keypair(1025, allow_insecure_key_size=True)
    small_public, _ = generate_keypair(512, allow_insecure_key_size=True)
    assert small_public.n.bit_length() == 512


def test_generated_primes_have_the_shape_the_djn_argument_needs(keypair):
    _, private_key = keypair
    p, q = private_key.p, private_key.q
    assert p % 4 == 3 and q % 4 == 3
    assert math.gcd(p - 1, q - 1) == 2


def test_key_dicts_roundtrip_through_json(keypair):
    public_key, private_key = keypair
    public_copy = public_key_from_dict(json.loads(json.dumps(public_key_to_dict(public_key))))
    private_copy = private_key_from_dict(json.loads(json.dumps(private_key_to_dict(private_key))))
    assert public_copy == public_key
    assert private_copy == private_key
    ciphertext = public_key.raw_encrypt(12345)
    assert private_copy.raw_decrypt(ciphertext) == 12345


def test_key_dicts_reject_tampering(keypair):
    public_key, private_key = keypair
    tampered = private_key_to_dict(private_key) | {"p": str(private_key.p + 2)}
    with pytest.raises(KeyFormatError, match="p \\* q != n"):
        private_key_from_dict(tampered)
    with pytest.raises(KeyFormatError, match="expected key type"):
        private_key_from_dict(public_key_to_dict(public_key))
    with pytest.raises(KeyFormatError, match="decimal"):
        public_key_from_dict(public_key_to_dict(public_key) | {"n": "12ab"})


# ---------------------------------------------------------------------------- phe compatibility


def test_our_ciphertexts_decrypt_with_phe_and_vice_versa(keypair):
    public_key, private_key = keypair
    values = [0, 1, -1, 2**200, -(2**200), 987654321]
    for mode in ("full", "short", "standard"):
        encrypted = cipher.encrypt(public_key, values, mode)
        assert [private_key.raw_decrypt(c) for c in encrypted] == [v % public_key.n for v in values]
    plaintexts = [secrets.randbelow(public_key.n) for _ in range(8)]
    phe_ciphertexts = [public_key.raw_encrypt(m) for m in plaintexts]
    ours = CrtDecryptor.from_private_key(private_key).decrypt_many(phe_ciphertexts)
    assert [int(m) for m in ours] == plaintexts


# ---------------------------------------------------------------------------- X^T [[d]]


def naive_products(bases: list[mpz], exponents: np.ndarray, modulus: mpz) -> list[mpz]:
    results = []
    for column in exponents.T:
        product = mpz(1)
        for base, exponent in zip(bases, column.tolist(), strict=True):
            product = product * gmpy2.powmod(base, exponent, modulus) % modulus
        results.append(product)
    return results


def test_multiexp_equals_one_powmod_per_entry(rng):
    modulus = gmpy2.next_prime(mpz(secrets.randbits(512)))  # every non-zero base is invertible
    rows = 300
    bases = [mpz(secrets.randbelow(int(modulus) - 1) + 1) for _ in range(rows)]
    exponents = np.column_stack(
        [
            rng.integers(-(2**23), 2**23, rows),  # dense signed, FATE-like features
            rng.integers(0, 2, rows),  # binary
            rng.integers(-1, 2, rows),  # ternary
            np.zeros(rows, dtype=np.int64),  # all zero
            rng.integers(-(2**61), 2**61, rows),  # extreme magnitudes
            np.where(rng.random(rows) < 0.05, rng.integers(1, 9, rows), 0),  # sparse small
        ]
    ).astype(np.int64)
    exponents[0, 0] = 2**23
    assert multiexp_columns(bases, exponents, modulus) == naive_products(bases, exponents, modulus)
    one = np.array([[5]], dtype=np.int64)
    assert multiexp_columns(bases[:1], one, modulus) == [gmpy2.powmod(bases[0], 5, modulus)]


def test_planner_uses_cheap_plans_for_simple_columns(rng):
    binary = rng.integers(0, 2, 1000).astype(np.int64)
    plan = plan_column(binary)
    assert plan.window == 1
    assert plan.multiplications <= int(binary.sum())
    dense = rng.integers(-(2**23), 2**23, 1000).astype(np.int64)
    per_entry = plan_column(dense).multiplications / 1000
    assert per_entry < 6  # vs ~25 squarings per entry for one powmod each


# ---------------------------------------------------------------------------- process pool


def test_chunk_bounds_cover_the_range_exactly():
    for length in (0, 1, 7, 300):
        for parts in (1, 2, 5, 400):
            bounds = chunk_bounds(length, parts)
            covered = [i for start, stop in bounds for i in range(start, stop)]
            assert covered == list(range(length))
            assert all(stop > start for start, stop in bounds)


def test_process_pool_gives_the_serial_results(keypair, rng, monkeypatch):
    public_key, private_key = keypair
    monkeypatch.delenv(cipher.DASK_ADDRESS_VARIABLE, raising=False)
    monkeypatch.setattr(cipher, "_parallel_backend", None)
    d = rng.integers(-(2**40), 2**40, 600).tolist()
    X = rng.integers(-(2**20), 2**20, (600, 12))  # column chunks on the pool
    encrypted = cipher.encrypt(public_key, d)  # 600 values: obfuscators made on the pool
    assert isinstance(cipher._parallel_backend, ProcessBackend)
    assert len(set(encrypted)) == 600 and cipher.decrypt(private_key, encrypted) == d
    on_pool = cipher.transpose_dot(public_key, X, encrypted)
    monkeypatch.setattr(cipher, "_PARALLEL_MIN_WORK", 10**9)  # everything serial now
    assert cipher.transpose_dot(public_key, X, encrypted) == on_pool
    assert (
        cipher.decrypt(private_key, on_pool) == (X.T.astype(object) @ np.array(d, object)).tolist()
    )


def _encrypt_in_a_child() -> None:
    public, _ = paillier.generate_paillier_keypair(n_length=512)
    cipher.encrypt(public, list(range(600)), randomizer="standard")  # large: the process pool


def test_a_multiprocessing_child_that_used_the_pool_exits() -> None:
    """Prefect's runner starts each flow run as a multiprocessing child; its exit must not wait
    forever on the pool's idle workers (a served deployment's process never ended)."""
    child = multiprocessing.get_context("spawn").Process(target=_encrypt_in_a_child)
    child.start()
    child.join(120)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0


@pytest.mark.parametrize("kernel", [True, False])
def test_pack_shifts_and_adds_each_run_of_slots(keypair, kernel, monkeypatch):
    """cipher.pack against the plaintext sum it must encrypt, on the kernel's fixed-exponent
    powers and on gmpy2's, with a last run shorter than the others and negative entries."""
    if kernel and not native.fixed_exponent_preferred():
        pytest.skip(f"fixed-exponent powers use the kernel on IFMA only: {native.current_path()}")
    monkeypatch.setattr(native, "fixed_exponent_preferred", lambda: kernel)
    public, private = keypair
    values = [secrets.randbelow(2**90) - 2**89 for _ in range(11)] + [-1, 0]
    slot, slots = 150, 5
    packed = cipher.pack(public, cipher.encrypt(public, values), slot, slots)
    assert len(packed) == 3
    runs = [values[a : a + slots] for a in range(0, len(values), slots)]
    expected = [sum(v << (slot * j) for j, v in enumerate(run)) for run in runs]
    assert cipher.decrypt(private, packed) == expected
