"""Keys, encoding and EncryptedVector operations checked against phe and exact integers."""

from __future__ import annotations

import json
import math
import secrets

import numpy as np
import pytest
from phe.paillier import EncodedNumber, EncryptedNumber, PaillierPublicKey

from core.paillier import (
    EncodedMatrix,
    EncodingError,
    EncryptedVector,
    KeyFormatError,
    KeyMismatchError,
    KeySizeError,
    PaillierOverflowError,
    ShapeError,
    WireFormatError,
    check_sum_of_products_fits,
    encode_matrix,
    encode_values,
    generate_keypair,
    max_safe_magnitude,
    private_key_from_dict,
    private_key_to_dict,
    public_key_from_dict,
    public_key_to_dict,
)
from core.paillier.decryption import CrtDecryptor

TEST_KEY_BITS = 1024


@pytest.fixture(scope="module")
def keypair():
    return generate_keypair(TEST_KEY_BITS, allow_insecure_key_size=True)


@pytest.fixture(scope="module")
def other_keypair():
    return generate_keypair(TEST_KEY_BITS, allow_insecure_key_size=True)


@pytest.fixture()
def rng():
    return np.random.default_rng(secrets.randbits(32))


def tricky_values(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random reals plus zeros, negatives and extreme magnitudes."""
    values = rng.standard_normal(size) * 10.0 ** rng.integers(-6, 7, size)
    values[:6] = [0.0, -0.0, 1e9, -1e9, 2.0**-30, -(2.0**-30)]
    return values


def phe_exact(public_key: PaillierPublicKey, value: float, frac_bits: int) -> EncodedNumber:
    """phe encoding with the same precision as ours (phe's base is 16)."""
    assert frac_bits % 4 == 0
    return EncodedNumber.encode(public_key, value, precision=2.0**-frac_bits)


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


def test_our_ciphertexts_decrypt_with_phe_and_vice_versa(keypair, rng):
    public_key, private_key = keypair
    values = tricky_values(rng, 12)
    vector = EncryptedVector.encrypt(public_key, values, frac_bits=32)
    expected = [v % public_key.n for v in encode_values(values, 32)]
    assert [private_key.raw_decrypt(int(c)) for c in vector.ciphertexts] == expected

    plaintexts = [secrets.randbelow(public_key.n) for _ in range(8)]
    phe_ciphertexts = [public_key.raw_encrypt(m) for m in plaintexts]
    ours = CrtDecryptor.from_private_key(private_key).decrypt_many(phe_ciphertexts)
    assert [int(m) for m in ours] == plaintexts


def test_roundtrip_with_zeros_negatives_and_extremes(keypair, rng):
    public_key, private_key = keypair
    values = tricky_values(rng, 20)
    vector = EncryptedVector.encrypt(public_key, values, frac_bits=40)
    expected = np.asarray(encode_values(values, 40), dtype=object)
    assert vector.decrypt_integers(private_key) == list(expected)
    np.testing.assert_allclose(vector.decrypt(private_key), values, rtol=0, atol=2.0**-40)

    bound = max_safe_magnitude(public_key.n)
    edge = EncryptedVector.encrypt_encoded(public_key, [bound, -bound, 0, 1, -1], frac_bits=0)
    assert edge.decrypt_integers(private_key) == [bound, -bound, 0, 1, -1]


def test_to_phe_and_from_phe_agree_with_phe_decryption(keypair, rng):
    public_key, private_key = keypair
    values = tricky_values(rng, 10)
    for frac_bits in (32, 30):  # 30 is not a multiple of phe's 4-bit base and gets lifted
        vector = EncryptedVector.encrypt(public_key, values, frac_bits=frac_bits)
        via_phe = [private_key.decrypt(number) for number in vector.to_phe()]
        assert via_phe == vector.decrypt(private_key).tolist()

    numbers = [public_key.encrypt(v) for v in (1.25, -3, 2**40, -7.5e-5, 0)]
    numbers.append(EncryptedNumber(public_key, public_key.raw_encrypt(3), exponent=2))
    imported = EncryptedVector.from_phe(numbers)
    assert imported.decrypt(private_key).tolist() == [private_key.decrypt(x) for x in numbers]


# ---------------------------------------------------------------------------- arithmetic vs phe


def test_addition_matches_phe(keypair, rng):
    public_key, private_key = keypair
    a, b = tricky_values(rng, 10), tricky_values(rng, 10)
    plain = rng.standard_normal(10)
    enc_a = EncryptedVector.encrypt(public_key, a, frac_bits=32)
    enc_b = EncryptedVector.encrypt(public_key, b, frac_bits=32)
    phe_a, phe_b = enc_a.to_phe(), enc_b.to_phe()

    def phe_decrypt(numbers):
        return [private_key.decrypt(x) for x in numbers]

    assert (enc_a + enc_b).decrypt(private_key).tolist() == phe_decrypt(
        [x + y for x, y in zip(phe_a, phe_b, strict=True)]
    )
    assert (enc_a - enc_b).decrypt(private_key).tolist() == phe_decrypt(
        [x - y for x, y in zip(phe_a, phe_b, strict=True)]
    )
    plain_encoded = [phe_exact(public_key, v, 32) for v in plain]
    assert (enc_a + plain).decrypt(private_key).tolist() == phe_decrypt(
        [x + e for x, e in zip(phe_a, plain_encoded, strict=True)]
    )
    assert (plain - enc_a).decrypt(private_key).tolist() == phe_decrypt(
        [e - x for x, e in zip(phe_a, plain_encoded, strict=True)]
    )
    assert (enc_a + 0).decrypt_integers(private_key) == enc_a.decrypt_integers(private_key)
    assert (-enc_a).decrypt_integers(private_key) == [
        -v for v in enc_a.decrypt_integers(private_key)
    ]


def test_adding_different_scales_lifts_exactly(keypair, rng):
    public_key, private_key = keypair
    a, b = rng.standard_normal(6), rng.standard_normal(6)
    enc_a = EncryptedVector.encrypt(public_key, a, frac_bits=20)
    enc_b = EncryptedVector.encrypt(public_key, b, frac_bits=33)
    total = enc_a + enc_b
    assert total.frac_bits == 33
    expected = [
        (x << 13) + y for x, y in zip(encode_values(a, 20), encode_values(b, 33), strict=True)
    ]
    assert total.decrypt_integers(private_key) == expected
    with pytest.raises(EncodingError, match="cannot lower the scale"):
        enc_b.with_frac_bits(20)


def test_multiplication_matches_phe_and_exact_products(keypair, rng):
    public_key, private_key = keypair
    values = tricky_values(rng, 10)
    factors = rng.standard_normal(10) * 100
    factors[:3] = [0.0, -1.0, 12345.678]
    vector = EncryptedVector.encrypt(public_key, values, frac_bits=32)
    phe_numbers = vector.to_phe()

    elementwise = vector * factors
    assert elementwise.frac_bits == 48
    expected = [
        private_key.decrypt(x * phe_exact(public_key, f, 16))
        for x, f in zip(phe_numbers, factors, strict=True)
    ]
    assert elementwise.decrypt(private_key).tolist() == expected
    exact = [
        x * f for x, f in zip(encode_values(values, 32), encode_values(factors, 16), strict=True)
    ]
    assert elementwise.decrypt_integers(private_key) == exact

    for scalar in (-2.75, 0.0, 3):
        scaled = (vector * scalar).decrypt(private_key).tolist()
        encoded = scalar if isinstance(scalar, int) else phe_exact(public_key, scalar, 16)
        assert scaled == [private_key.decrypt(x * encoded) for x in phe_numbers]
    with pytest.raises(ValueError, match="cannot multiply two ciphertexts"):
        vector * vector


def test_transpose_dot_matches_exact_integers_and_phe_loop(keypair, rng):
    public_key, private_key = keypair
    rows = 60
    d = tricky_values(rng, rows)
    d[rows // 2 :] = rng.uniform(-1, 1, rows - rows // 2)
    features = rng.standard_normal((rows, 6)) * 3
    features[:, 1] = rng.integers(0, 2, rows)  # binary column
    features[:, 2] = 0.0  # all-zero column
    features[:, 3] = -1.5  # constant negative column
    features[:5, 4] = [1e5, -1e5, 0.0, 2.0**-16, -(2.0**-16)]
    vector = EncryptedVector.encrypt(public_key, d, frac_bits=32)
    encoded = encode_matrix(features, 16)

    result = vector.transpose_dot(encoded)
    assert result.frac_bits == 48 and len(result) == 6
    d_int = np.asarray(encode_values(d, 32), dtype=object)
    exact = encoded.values.astype(object).T @ d_int
    assert result.decrypt_integers(private_key) == list(exact)

    phe_numbers = vector.to_phe()
    for column in (0, 1, 3):
        phe_sum = sum(
            phe_numbers[i] * phe_exact(public_key, features[i, column], 16) for i in range(rows)
        )
        assert result.decrypt(private_key)[column] == private_key.decrypt(phe_sum)
    assert not result.is_fresh


def test_subset_sums_and_sum(keypair, rng):
    public_key, private_key = keypair
    labels = rng.integers(-3, 4, 40).astype(float) / 4
    vector = EncryptedVector.encrypt(public_key, labels, frac_bits=32)
    selection = rng.integers(0, 2, (40, 5)).astype(bool)
    selection[:, 4] = False
    sums = vector.subset_sums(selection)
    assert sums.frac_bits == 32
    np.testing.assert_array_equal(sums.decrypt(private_key), labels @ selection)
    picked = np.array([3, 0, 17, 39])
    assert vector.subset_sum(picked).decrypt(private_key)[0] == labels[picked].sum()
    assert vector.sum().decrypt(private_key)[0] == labels.sum()
    with pytest.raises(ShapeError, match="distinct"):
        vector.subset_sum(np.array([1, 1]))
    with pytest.raises(EncodingError, match="0/1"):
        vector.subset_sums(np.full((40, 1), 2))


# ---------------------------------------------------------------- overflow and input errors


def test_overflow_is_detected_at_decryption(keypair):
    public_key, private_key = keypair
    bound = max_safe_magnitude(public_key.n)
    vector = EncryptedVector.encrypt_encoded(public_key, [bound // 2, 5], frac_bits=0)
    with pytest.raises(PaillierOverflowError, match="position 0"):
        (vector * 4).decrypt(private_key)
    doubled = vector + vector  # bound - 1 is still fine, 2 * (bound // 2) <= bound
    assert doubled.decrypt_integers(private_key)[1] == 10


def test_overflow_is_ruled_out_before_transpose_dot(keypair, rng):
    public_key, _ = keypair
    vector = EncryptedVector.encrypt(public_key, rng.uniform(-1, 1, 4), frac_bits=1000)
    matrix = encode_matrix(rng.standard_normal((4, 2)) * 1e3, 16)
    with pytest.raises(PaillierOverflowError, match="safe range"):
        vector.transpose_dot(matrix, max_abs_value=1.0)
    spare = check_sum_of_products_fits(
        public_key.n, terms=30_000, max_abs_multiplier=2**23, max_abs_value=2**32
    )
    assert spare > 900


def test_bad_inputs_raise_clear_value_errors(keypair, other_keypair):
    public_key, _ = keypair
    vector = EncryptedVector.encrypt(public_key, [1.0, 2.0])
    with pytest.raises(EncodingError, match="position 1"):
        EncryptedVector.encrypt(public_key, [1.0, np.nan])
    with pytest.raises(EncodingError, match="safe encoding range"):
        EncryptedVector.encrypt_encoded(public_key, [public_key.n], frac_bits=0)
    with pytest.raises(ShapeError, match="length 3"):
        vector + np.ones(3)
    with pytest.raises(KeyMismatchError):
        vector + EncryptedVector.encrypt(other_keypair[0], [1.0, 2.0])
    with pytest.raises(KeyMismatchError):
        vector.decrypt(other_keypair[1])
    with pytest.raises(ShapeError, match="row count"):
        vector.transpose_dot(EncodedMatrix(np.ones((3, 1), dtype=np.int64), 0))
    with pytest.raises(EncodingError, match="62 bits"):
        encode_matrix(np.array([[1e30]]))


# ---------------------------------------------------------------------------- structure and wire


def test_slicing_and_concat(keypair, rng):
    public_key, private_key = keypair
    a, b = rng.standard_normal(7), rng.standard_normal(3)
    enc_a = EncryptedVector.encrypt(public_key, a, frac_bits=32)
    enc_b = EncryptedVector.encrypt(public_key, b, frac_bits=24)
    assert enc_a[2:5].decrypt(private_key).tolist() == enc_a.decrypt(private_key)[2:5].tolist()
    assert enc_a[-1].decrypt(private_key)[0] == enc_a.decrypt(private_key)[-1]
    mask = np.array([True, False] * 3 + [True])
    assert enc_a[mask].decrypt(private_key).tolist() == enc_a.decrypt(private_key)[mask].tolist()
    joined = EncryptedVector.concat([enc_a, enc_b])
    assert joined.frac_bits == 32 and len(joined) == 10
    expected = np.concatenate([enc_a.decrypt(private_key), enc_b.decrypt(private_key)])
    assert joined.decrypt(private_key).tolist() == expected.tolist()


def test_wire_roundtrip_rerandomizes_computed_vectors(keypair, other_keypair, rng):
    public_key, private_key = keypair
    vector = EncryptedVector.encrypt(public_key, rng.standard_normal(5))
    message = json.loads(json.dumps(vector.to_wire()))
    received = EncryptedVector.from_wire(public_key, message)
    assert received.ciphertexts == vector.ciphertexts
    assert received.decrypt(private_key).tolist() == vector.decrypt(private_key).tolist()

    computed = vector * 3
    sent = EncryptedVector.from_wire(public_key, computed.to_wire())
    assert set(sent.ciphertexts).isdisjoint(computed.ciphertexts)
    assert sent.decrypt_integers(private_key) == computed.decrypt_integers(private_key)

    with pytest.raises(KeyMismatchError):
        EncryptedVector.from_wire(other_keypair[0], message)
    with pytest.raises(WireFormatError, match="ciphertexts"):
        EncryptedVector.from_wire(public_key, message | {"ciphertexts": ["1"]})
    with pytest.raises(WireFormatError, match=r"\(0, n\^2\)"):
        EncryptedVector.from_wire(public_key, message | {"ciphertexts": [public_key.nsquare]})
