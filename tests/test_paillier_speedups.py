"""Multi-exponentiation, fast randomizers, obfuscator pool and packing."""

from __future__ import annotations

import secrets

import gmpy2
import numpy as np
import pytest
from gmpy2 import mpz
from phe.paillier import PaillierPublicKey

from core.paillier import (
    DJNRandomizer,
    EncryptedVector,
    ObfuscatorPool,
    PackedEncryptedVector,
    PackingError,
    PaillierError,
    PaillierOverflowError,
    StandardRandomizer,
    encode_values,
    generate_keypair,
    multiexp_columns,
    pack,
    packing_capacity,
)
from core.paillier.multiexp import plan_column

TEST_KEY_BITS = 1024


@pytest.fixture(scope="module")
def keypair():
    return generate_keypair(TEST_KEY_BITS, allow_insecure_key_size=True)


@pytest.fixture()
def rng():
    return np.random.default_rng(secrets.randbits(32))


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


def test_djn_ciphertexts_decrypt_and_are_fresh(keypair, rng):
    public_key, private_key = keypair
    randomizer = DJNRandomizer(public_key)
    assert randomizer.exponent_bits == TEST_KEY_BITS // 2
    values = rng.standard_normal(20)
    values[:5] = 0.0
    vector = EncryptedVector.encrypt(public_key, values, randomizer=randomizer)
    assert vector.decrypt_integers(private_key) == encode_values(values, 32)
    zeros = EncryptedVector.encrypt(public_key, np.zeros(40), randomizer=randomizer)
    assert len(set(zeros.ciphertexts)) == 40
    assert all(int(m) == 0 for m in zeros.decrypt_integers(private_key))
    obfuscators = randomizer.obfuscators(200)
    assert len(set(obfuscators)) == 200
    rerandomized = vector.rerandomize(randomizer)
    assert set(rerandomized.ciphertexts).isdisjoint(vector.ciphertexts)
    assert rerandomized.decrypt_integers(private_key) == vector.decrypt_integers(private_key)


def test_djn_refuses_moduli_of_the_wrong_shape():
    p, q = gmpy2.next_prime(2**300), gmpy2.next_prime(2**301)
    while (p * q) % 4 == 1:
        q = gmpy2.next_prime(q)
    with pytest.raises(PaillierError, match="3 \\(mod 4\\)"):
        DJNRandomizer(PaillierPublicKey(int(p * q)))


def test_standard_obfuscators_are_fresh_nth_residues(keypair):
    public_key, private_key = keypair
    obfuscators = StandardRandomizer(public_key).obfuscators(30)
    assert len(set(obfuscators)) == 30
    assert all(private_key.raw_decrypt(int(r)) == 0 for r in obfuscators)


def test_pool_hands_each_obfuscator_out_once(keypair, rng):
    public_key, private_key = keypair
    pool = ObfuscatorPool(StandardRandomizer(public_key))
    pool.fill(12)
    assert len(pool) == 12
    first = pool.obfuscators(5)
    second = pool.obfuscators(10)  # 7 from the pool, 3 computed on demand
    assert len(pool) == 0 and pool.computed_on_demand == 3
    assert len(set(first) | set(second)) == 15
    pool.start_background_fill(16, batch_size=4)
    pool.wait_for_background_fill(timeout=60)
    assert len(pool) == 16
    values = rng.standard_normal(16)
    vector = EncryptedVector.encrypt(public_key, values, randomizer=pool)
    assert len(pool) == 0
    assert vector.decrypt_integers(private_key) == encode_values(values, 32)


def test_pool_rejects_a_foreign_key(keypair):
    other_public, _ = generate_keypair(512, allow_insecure_key_size=True)
    pool = ObfuscatorPool(StandardRandomizer(other_public))
    with pytest.raises(ValueError, match="different public key"):
        EncryptedVector.encrypt(keypair[0], [1.0], randomizer=pool)


def test_packing_roundtrip_and_capacity_rule(keypair, rng):
    public_key, private_key = keypair
    values = rng.uniform(-1, 1, 45)
    values[:4] = [0.0, 1.0, -1.0, 2.0**-32]
    vector = EncryptedVector.encrypt(public_key, values, frac_bits=32)
    packed = pack(vector, max_abs_value=1.0)
    # |v| <= 2**32 encoded needs 33 value bits, 35-bit slots, floor(1023 / 35) = 29 slots.
    assert packed.layout.value_bits == 33 and packed.layout.slot_bits == 35
    assert packing_capacity(public_key, 33) == 29 == packed.layout.slots_per_ciphertext
    assert len(packed.ciphertexts) == 2
    assert packed.decrypt_integers(private_key) == vector.decrypt_integers(private_key)
    received = PackedEncryptedVector.from_wire(public_key, packed.to_wire())
    assert received.decrypt(private_key).tolist() == vector.decrypt(private_key).tolist()
    assert set(received.ciphertexts).isdisjoint(packed.ciphertexts)
    with pytest.raises(PackingError, match="do not fit"):
        packing_capacity(public_key, 2000)


@pytest.mark.parametrize("culprit", [1.7, -1.7])
def test_packing_detects_values_beyond_the_promised_bound(keypair, culprit):
    public_key, private_key = keypair
    values = np.array([0.5, culprit, -0.25, 0.75])
    packed = pack(EncryptedVector.encrypt(public_key, values), max_abs_value=1.0)
    with pytest.raises(PaillierOverflowError, match="position 1"):
        packed.decrypt(private_key)
