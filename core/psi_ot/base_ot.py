"""Base oblivious transfers: Naor-Pinkas OT on NIST P-256, random-OT form, semi-honest.

Naor and Pinkas, "Efficient oblivious transfer protocols", SODA 2001, their two-round
1-out-of-2 protocol secure under computational Diffie-Hellman in the random-oracle model, as
used for the base OTs of OT-extension PSI by Pinkas, Schneider and Zohner (USENIX Security
2014). The OT sender fixes one random point ``C`` and one ``R = rG`` for all ``k`` transfers:

1. sender -> receiver: ``C``, ``R`` (:func:`sender_setup`);
2. receiver: for transfer ``j`` with choice bit ``b`` picks ``k_j``, sets
   ``PK_b = k_j G`` and ``PK_{1-b} = C - PK_b``, sends ``PK_0`` (:func:`receiver_choose`), and
   keeps the key ``H(j, x(k_j R))``;
3. sender: ``PK_1 = C - PK_0``, keys ``H(j, x(r PK_0))`` and ``H(j, x(r PK_1))``
   (:func:`sender_keys`). The receiver's key equals the one of its choice; the other needs
   ``r (C - k_j G)``, i.e. the discrete log of ``C``, which the receiver does not know.

This is a random OT: the two 16-byte keys are the OT extension's seeds, nothing is encrypted.
Why P-256: every published base OT needs the group operation (``C - PK``) beside scalar
multiplication, and ``cryptography`` exposes X25519 only as x-only Diffie-Hellman. Scalar
multiplications run in OpenSSL (``cryptography``); only the subtraction of public points is
done here with Python integers, all ``k`` of a side's subtractions sharing one modular
inversion (Montgomery's trick: an inversion costs as much as the rest of a subtraction). Secret
scalars come from the party's PRG key
(:mod:`.primitives`), drawn from the OS CSPRNG.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from core.psi_ot.primitives import KEY_BYTES, prg

CURVE = ec.SECP256R1()
# NIST P-256 (FIPS 186-4, D.1.2.3): y^2 = x^3 - 3x + b over GF(p), prime order N.
P = 2**256 - 2**224 + 2**192 + 2**96 - 1
N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
POINT_BYTES = 65  # SEC 1 uncompressed encoding
_DOMAIN = b"privreg/psi-ot/np01/v1\x00"


class BaseOtError(ValueError):
    """A base-OT message that is not what an honest party sends."""


def scalars(key: bytes, count: int, stream: int) -> list[int]:
    """``count`` scalars in [1, N) from the PRG (40 bytes each: the bias is below 2^-64)."""
    data = prg(key, 40 * count, stream)
    return [int.from_bytes(data[40 * i : 40 * (i + 1)], "big") % (N - 1) + 1 for i in range(count)]


def _public(scalar: int) -> ec.EllipticCurvePublicKey:
    return ec.derive_private_key(scalar, CURVE).public_key()


def encode(point: ec.EllipticCurvePublicKey) -> bytes:
    return point.public_bytes(Encoding.X962, PublicFormat.UncompressedPoint)


def decode(data: bytes, what: str) -> ec.EllipticCurvePublicKey:
    """A point from its uncompressed encoding; ``cryptography`` refuses points off the curve."""
    if len(data) != POINT_BYTES or data[0] != 4:
        raise BaseOtError(f"{what} is not an uncompressed P-256 point ({len(data)} bytes)")
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(CURVE, bytes(data))
    except ValueError as error:
        raise BaseOtError(f"{what} is not a point of P-256: {error}") from None


def _xy(point: ec.EllipticCurvePublicKey) -> tuple[int, int]:
    numbers = point.public_numbers()
    return numbers.x, numbers.y


def subtract(
    a: ec.EllipticCurvePublicKey, b: ec.EllipticCurvePublicKey
) -> ec.EllipticCurvePublicKey:
    """``a - b`` in affine coordinates (public points only: no secret flows through here)."""
    x, y = _differences(_xy(a), [_xy(b)])[0]
    return ec.EllipticCurvePublicNumbers(x, y, CURVE).public_key()


def _coordinates(encoded: bytes) -> tuple[int, int]:
    """``(x, y)`` of an uncompressed encoding already checked to be a point (cheaper than
    asking OpenSSL for the key's numbers)."""
    return int.from_bytes(encoded[1:33], "big"), int.from_bytes(encoded[33:65], "big")


def _encoded(x: int, y: int) -> bytes:
    """The uncompressed encoding of the point ``(x, y)`` (as :func:`encode` gives it)."""
    return b"\x04" + x.to_bytes(32, "big") + y.to_bytes(32, "big")


def _inverses(values: list[int]) -> list[int]:
    """The inverses mod ``P`` of nonzero ``values`` with one modular inversion (Montgomery's
    simultaneous inversion): an inversion costs about as much as 200 multiplications."""
    prefix, running = [], 1
    for value in values:
        prefix.append(running)
        running = running * value % P
    inverse, out = pow(running, -1, P), [0] * len(values)
    for index in range(len(values) - 1, -1, -1):
        out[index] = inverse * prefix[index] % P
        inverse = inverse * values[index] % P
    return out


def _differences(a: tuple[int, int], points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``a - b`` for each affine point ``b`` (public points only: no secret flows through
    here), the slopes' denominators inverted at once. Refuses a ``b`` equal to ``a`` or
    ``-a`` (a difference at infinity, or a doubling)."""
    ax, ay = a
    if any(bx == ax for bx, _ in points):
        raise BaseOtError("C - PK is the point at infinity or needs doubling: refused")
    out = []
    for (bx, by), inverse in zip(points, _inverses([bx - ax for bx, _ in points]), strict=True):
        slope = ((-by) % P - ay) * inverse % P
        x = (slope * slope - ax - bx) % P
        out.append((x, (slope * (ax - x) - ay) % P))
    return out


def _key(index: int, shared_x: bytes) -> bytes:
    return hashlib.sha256(_DOMAIN + index.to_bytes(4, "big") + shared_x).digest()[:KEY_BYTES]


@dataclass(frozen=True)
class SenderSecret:
    c: int
    r: int

    def message(self) -> bytes:
        """Step 1: ``C || R``."""
        return encode(_public(self.c)) + encode(_public(self.r))


def sender_setup(key: bytes, stream: int) -> SenderSecret:
    """``c`` and ``r`` from the party's PRG key (itself from the OS CSPRNG)."""
    c, r = scalars(key, 2, stream)
    return SenderSecret(c, r)


@dataclass(frozen=True)
class ReceiverChoice:
    message: bytes  # the PK_0 of every transfer, concatenated: sent to the OT sender
    keys: list[bytes]  # the chosen key of every transfer: stays with the receiver


def receiver_choose(
    setup: bytes, choices: Sequence[int], key: bytes, stream: int
) -> ReceiverChoice:
    """Step 2: ``PK_0`` for each choice bit, and the chosen keys (``k_j`` from the PRG key)."""
    if len(setup) != 2 * POINT_BYTES:
        raise BaseOtError(f"the base-OT setup has {len(setup)} bytes, not {2 * POINT_BYTES}")
    c_point = decode(setup[:POINT_BYTES], "the base-OT point C")
    r_point = decode(setup[POINT_BYTES:], "the base-OT point R")
    privates = [ec.derive_private_key(k, CURVE) for k in scalars(key, len(choices), stream)]
    chosen = [encode(private.public_key()) for private in privates]  # PK_b = k_j G
    others = _differences(_xy(c_point), [_coordinates(point) for point in chosen])
    parts, keys = [], []
    for index, (bit, private) in enumerate(zip(choices, privates, strict=True)):
        # PK_{1-b} = C - PK_b is computed for either bit: the same work both ways
        parts.append(_encoded(*others[index]) if bit else chosen[index])
        keys.append(_key(index, private.exchange(ec.ECDH(), r_point)))
    return ReceiverChoice(b"".join(parts), keys)


def sender_keys(secret: SenderSecret, message: bytes, count: int) -> list[tuple[bytes, bytes]]:
    """Step 3: both keys of each of ``count`` transfers from the receiver's ``PK_0`` values."""
    if len(message) != count * POINT_BYTES:
        raise BaseOtError(
            f"the base-OT choice message has {len(message)} bytes, not {count} points"
        )
    r_secret, pairs = ec.derive_private_key(secret.r, CURVE), []
    encoded = [message[i * POINT_BYTES : (i + 1) * POINT_BYTES] for i in range(count)]
    pk0s = [decode(point, f"PK_0 #{index}") for index, point in enumerate(encoded)]
    pk1s = _differences(_xy(_public(secret.c)), [_coordinates(point) for point in encoded])
    for index, (pk0, pk1_xy) in enumerate(zip(pk0s, pk1s, strict=True)):
        pk1 = ec.EllipticCurvePublicNumbers(*pk1_xy, CURVE).public_key()  # PK_1 = C - PK_0
        shared = (r_secret.exchange(ec.ECDH(), pk) for pk in (pk0, pk1))
        pairs.append(tuple(_key(index, x) for x in shared))
    return pairs
