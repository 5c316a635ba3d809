"""Key generation and key (de)serialisation, compatible with ``phe`` key objects.

Keys are plain ``phe.paillier.PaillierPublicKey`` / ``PaillierPrivateKey`` instances so that
every flow can still use ``phe`` directly; this module only adds a generator that refuses
short keys by default and uses the OS CSPRNG, and a persistence format made of plain strings.
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
from typing import Any

import gmpy2
from phe.paillier import PaillierPrivateKey, PaillierPublicKey

from core.paillier.errors import KeyFormatError, KeySizeError, PeerKeyError
from core.test_switches import SMALL_KEYS_VARIABLE, small_keys_allowed

DEFAULT_KEY_BITS = 2048
"""Default modulus length: about 112-bit security (NIST SP 800-57 Part 1, Table 2)."""

MIN_SECURE_KEY_BITS = 2048
"""Below this a key is only accepted in a process with :data:`SMALL_KEYS_VARIABLE` set
(tests, benchmarks, demos)."""


def check_key_size(key_size: int) -> None:
    """A flow's ``key_size``, refused below 2048 bits unless this process opted in; checked
    before anything is read or sent."""
    if key_size < MIN_SECURE_KEY_BITS and not small_keys_allowed():
        raise KeySizeError(
            f"key_size={key_size} is below {MIN_SECURE_KEY_BITS} bits; smaller keys are for "
            f"tests and benchmarks only and need {SMALL_KEYS_VARIABLE}=1 in the environment"
        )


_MIN_ANY_KEY_BITS = 256
_PRIME_TEST_ROUNDS = 40
_PUBLIC_KEY_TYPE = "paillier-public-key"
_PRIVATE_KEY_TYPE = "paillier-private-key"
_FORMAT_VERSION = 1


def generate_keypair(
    n_length: int = DEFAULT_KEY_BITS, *, allow_insecure_key_size: bool = False
) -> tuple[PaillierPublicKey, PaillierPrivateKey]:
    """Generate a Paillier key pair whose modulus has exactly ``n_length`` bits.

    The primes are drawn with ``secrets`` and satisfy p = q = 3 (mod 4) and
    gcd(p - 1, q - 1) = 2: the modulus shape the Damgard-Jurik-Nielsen fast randomizer's
    security argument is stated for (see ``randomness``); it costs nothing for the standard
    scheme.
    """
    _validate_key_length(n_length, allow_insecure_key_size)
    prime_bits = n_length // 2
    while True:
        p = _random_blum_prime(prime_bits)
        q = _random_blum_prime(prime_bits)
        if _is_acceptable_modulus(p, q, n_length):
            break
    public_key = PaillierPublicKey(int(p * q))
    return public_key, PaillierPrivateKey(public_key, int(p), int(q))


def _validate_key_length(n_length: int, allow_insecure_key_size: bool) -> None:
    if not isinstance(n_length, int) or isinstance(n_length, bool):
        raise KeySizeError(f"n_length must be an int, got {type(n_length).__name__}")
    if n_length % 2:
        raise KeySizeError(f"n_length must be even (two equal-size primes), got {n_length}")
    if n_length < _MIN_ANY_KEY_BITS:
        raise KeySizeError(f"n_length={n_length} is below the absolute minimum {_MIN_ANY_KEY_BITS}")
    if n_length < MIN_SECURE_KEY_BITS and not allow_insecure_key_size:
        raise KeySizeError(
            f"n_length={n_length} is below {MIN_SECURE_KEY_BITS} bits and not secure; "
            "pass allow_insecure_key_size=True only for tests or demos (flows: "
            f"{SMALL_KEYS_VARIABLE}=1)"
        )


def _random_blum_prime(bits: int) -> gmpy2.mpz:
    """A random prime of exactly ``bits`` bits, = 3 mod 4, with its two top bits set.

    Setting the two top bits guarantees that the product of two such primes has exactly
    ``2 * bits`` bits.
    """
    top_bits = 0b11 << (bits - 2)
    while True:
        candidate = gmpy2.mpz(secrets.randbits(bits) | top_bits | 0b11)
        if gmpy2.is_prime(candidate, _PRIME_TEST_ROUNDS):
            return candidate


def _is_acceptable_modulus(p: gmpy2.mpz, q: gmpy2.mpz, n_length: int) -> bool:
    if p == q:
        return False
    # Primes sharing their top half would make n easy to factor (Fermat's method).
    if abs(p - q).bit_length() < n_length // 2 - 100:
        return False
    if gmpy2.gcd(p - 1, q - 1) != 2:
        return False
    n = p * q
    return n.bit_length() == n_length and math.gcd(int(n), int((p - 1) * (q - 1))) == 1


SMALL_FACTOR_BOUND = 2**20
"""A peer's modulus with a prime factor below this is refused (trial division by a gcd)."""


@functools.cache
def _small_primorial() -> gmpy2.mpz:
    """The product of every prime below :data:`SMALL_FACTOR_BOUND` (1.5 Mbit, ~20 ms once)."""
    return gmpy2.primorial(SMALL_FACTOR_BOUND - 1)


def check_peer_modulus(
    n: object, *, expected_bits: int, allow_insecure_key_size: bool, holder: str
) -> int:
    """The modulus ``n`` a key holder sent, checked before this party encrypts anything under it.

    Why: whoever encrypts under a modulus the key holder chose trusts it to be hard to factor.
    A small key (a key holder that opted into small keys, or a malicious one) lets a
    peer that factors it read every value encrypted under it. So this party refuses, naming
    the key holder: a modulus shorter than :data:`MIN_SECURE_KEY_BITS` unless this party also
    opted into small keys; one of another size than the job's terms state; an even one; a
    perfect power; one with a prime factor below :data:`SMALL_FACTOR_BOUND`. These checks
    cannot prove n = pq with p, q prime and balanced (that needs a proof from the holder); they
    stop the cheap attacks. Returns ``n`` as an int.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 1:
        raise PeerKeyError(f"the public key from {holder} is not a modulus: {type(n).__name__}")
    bits = n.bit_length()
    refusal = f"refusing the {bits}-bit public key from key holder {holder}"
    if bits < MIN_SECURE_KEY_BITS and not allow_insecure_key_size:
        raise PeerKeyError(
            f"{refusal}: it is below {MIN_SECURE_KEY_BITS} bits, and this party did not opt "
            f"into smaller keys ({SMALL_KEYS_VARIABLE}=1, tests only)"
        )
    if bits != expected_bits:
        raise PeerKeyError(f"{refusal}: the job's terms state a {expected_bits}-bit key")
    if n % 2 == 0:
        raise PeerKeyError(f"{refusal}: the modulus is even")
    if gmpy2.is_power(n):
        raise PeerKeyError(f"{refusal}: the modulus is a perfect power")
    factor = gmpy2.gcd(n, _small_primorial())
    if factor != 1:
        raise PeerKeyError(
            f"{refusal}: the modulus has a prime factor below 2^20 (it divides {int(factor)})"
        )
    return n


def public_key_fingerprint(public_key: PaillierPublicKey) -> str:
    """Short stable identifier of a public key, for logs and for checking wire messages."""
    digest = hashlib.sha256(f"paillier:{public_key.n:x}".encode()).hexdigest()
    return digest[:32]


def public_key_to_dict(public_key: PaillierPublicKey) -> dict[str, Any]:
    """Serialise a public key to a dict of strings/ints (JSON and database friendly)."""
    _require_type(public_key, PaillierPublicKey, "public_key")
    return {"type": _PUBLIC_KEY_TYPE, "version": _FORMAT_VERSION, "n": str(public_key.n)}


def public_key_from_dict(data: dict[str, Any]) -> PaillierPublicKey:
    """Inverse of :func:`public_key_to_dict`; validates the structure."""
    _check_header(data, _PUBLIC_KEY_TYPE)
    n = _parse_positive_int(data, "n")
    if n.bit_length() < _MIN_ANY_KEY_BITS or n % 2 == 0:
        raise KeyFormatError(
            f"public key field 'n' is not a plausible modulus ({n.bit_length()} bits)"
        )
    return PaillierPublicKey(n)


def private_key_to_dict(private_key: PaillierPrivateKey) -> dict[str, Any]:
    """Serialise a private key (the factors of n). Store it encrypted at rest."""
    _require_type(private_key, PaillierPrivateKey, "private_key")
    return {
        "type": _PRIVATE_KEY_TYPE,
        "version": _FORMAT_VERSION,
        "n": str(private_key.public_key.n),
        "p": str(private_key.p),
        "q": str(private_key.q),
    }


def private_key_from_dict(data: dict[str, Any]) -> PaillierPrivateKey:
    """Inverse of :func:`private_key_to_dict`; checks that p and q are primes with p*q = n."""
    _check_header(data, _PRIVATE_KEY_TYPE)
    n = _parse_positive_int(data, "n")
    p = _parse_positive_int(data, "p")
    q = _parse_positive_int(data, "q")
    if p * q != n:
        raise KeyFormatError("private key fields are inconsistent: p * q != n")
    for name, factor in (("p", p), ("q", q)):
        if not gmpy2.is_prime(factor, 25):
            raise KeyFormatError(f"private key field {name!r} is not prime")
    return PaillierPrivateKey(PaillierPublicKey(n), p, q)


def _require_type(value: object, expected: type, name: str) -> None:
    if not isinstance(value, expected):
        raise KeyFormatError(f"{name} must be a {expected.__name__}, got {type(value).__name__}")


def _check_header(data: dict[str, Any], expected_type: str) -> None:
    if not isinstance(data, dict):
        raise KeyFormatError(f"serialised key must be a dict, got {type(data).__name__}")
    if data.get("type") != expected_type:
        raise KeyFormatError(f"expected key type {expected_type!r}, got {data.get('type')!r}")
    if data.get("version") != _FORMAT_VERSION:
        raise KeyFormatError(f"unsupported key format version {data.get('version')!r}")


def _parse_positive_int(data: dict[str, Any], field: str) -> int:
    raw = data.get(field)
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise KeyFormatError(f"key field {field!r} must be an int or a decimal string")
    try:
        value = int(raw)
    except ValueError as exc:
        raise KeyFormatError(f"key field {field!r} is not a decimal integer") from exc
    if value <= 1:
        raise KeyFormatError(f"key field {field!r} must be > 1")
    return value
