"""Packing several small encrypted values into one ciphertext.

When a vector is sent to the key holder only to be decrypted (e.g. a masked gradient), each
ciphertext costs one decryption and 512 bytes on the wire (2048-bit key) although the value
inside needs ~100 bits. Packing combines K ciphertexts homomorphically into one whose
plaintext holds value_j + 2**value_bits in bit slot j, so decryption and transfer shrink
K-fold for about ``slot_bits`` squarings per value.

Capacity rule: with |value| < 2**value_bits (in encoded units), a slot needs
``slot_bits = value_bits + 2`` bits (one for the offset that makes values non-negative, one
guard bit that catches a value up to twice the promised bound), and a ciphertext holds
``floor((bits(n) - 1) / slot_bits)`` slots so the packed plaintext stays below n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gmpy2 import mpz
from phe.paillier import PaillierPrivateKey, PaillierPublicKey

from core.paillier import kernels
from core.paillier.encoding import decode_values, validate_frac_bits, value_bound_to_integer
from core.paillier.errors import (
    KeyMismatchError,
    PackingError,
    PaillierOverflowError,
    WireFormatError,
)
from core.paillier.keys import public_key_fingerprint
from core.paillier.parallel import SERIAL, Backend, chunk_bounds
from core.paillier.randomness import Randomizer, StandardRandomizer
from core.paillier.vector import EncryptedVector

WIRE_FORMAT = "privreg.paillier.packed"
WIRE_VERSION = 1


@dataclass(frozen=True)
class PackingLayout:
    """Slot geometry for values bounded by |v| < 2**value_bits under an n of ``key_bits``."""

    value_bits: int
    slot_bits: int
    slots_per_ciphertext: int

    @classmethod
    def for_key(cls, n: int, value_bits: int) -> PackingLayout:
        if isinstance(value_bits, bool) or not isinstance(value_bits, int) or value_bits < 1:
            raise PackingError(f"value_bits must be a positive int, got {value_bits!r}")
        slot_bits = value_bits + 2
        slots = (int(n).bit_length() - 1) // slot_bits
        if slots < 1:
            raise PackingError(
                f"values of {value_bits} bits do not fit a {int(n).bit_length()}-bit plaintext"
            )
        return cls(value_bits, slot_bits, slots)

    @classmethod
    def for_bound(cls, n: int, max_abs_encoded: int) -> PackingLayout:
        """Layout for values with |v| <= ``max_abs_encoded`` (encoded units)."""
        if isinstance(max_abs_encoded, bool) or not isinstance(max_abs_encoded, int):
            raise PackingError("the packing bound must be an int in encoded units")
        if max_abs_encoded < 0:
            raise PackingError(f"the packing bound must be >= 0, got {max_abs_encoded}")
        return cls.for_key(n, max(max_abs_encoded.bit_length(), 1))

    @property
    def offset(self) -> int:
        return 1 << self.value_bits


@dataclass(frozen=True)
class PackedEncryptedVector:
    """``length`` encrypted values packed ``layout.slots_per_ciphertext`` per ciphertext.

    ``max_abs_encoded`` is the promised bound |v| <= max_abs_encoded (encoded units); it is
    re-checked for every slot at decryption.
    """

    public_key: PaillierPublicKey
    ciphertexts: tuple[mpz, ...]
    length: int
    frac_bits: int
    max_abs_encoded: int
    fresh: bool = False

    @property
    def layout(self) -> PackingLayout:
        return PackingLayout.for_bound(self.public_key.n, self.max_abs_encoded)

    def decrypt_integers(
        self, private_key: PaillierPrivateKey, *, backend: Backend | None = None
    ) -> list[int]:
        """Signed encoded integers, checking every slot against the promised bound."""
        if int(private_key.public_key.n) != int(self.public_key.n):
            raise KeyMismatchError("the private key does not belong to this packed vector")
        runner = backend or SERIAL
        count = len(self.ciphertexts)
        bounds = chunk_bounds(count, max(1, min(runner.parallelism, count)))
        p, q = int(private_key.p), int(private_key.q)
        raw = runner.run(
            kernels.decrypt_chunk,
            [(p, q, self.ciphertexts[a:b]) for a, b in bounds],
            sensitive=True,
        )
        plaintexts = [int(m) for chunk in raw for m in chunk]
        return self._unpack(plaintexts)

    def _unpack(self, plaintexts: list[int]) -> list[int]:
        layout = self.layout
        mask = (1 << layout.slot_bits) - 1
        limit = 1 << (layout.value_bits + 1)
        values: list[int] = []
        for index, plaintext in enumerate(plaintexts):
            slots = min(layout.slots_per_ciphertext, self.length - len(values))
            if plaintext >> (slots * layout.slot_bits):
                raise PaillierOverflowError(
                    f"packed ciphertext {index} overflowed its top slot: a value exceeded the "
                    f"promised bound of {layout.value_bits} bits"
                )
            for slot in range(slots):
                stored = (plaintext >> (slot * layout.slot_bits)) & mask
                value = stored - layout.offset
                if not 0 < stored < limit or abs(value) > self.max_abs_encoded:
                    raise PaillierOverflowError(
                        f"packed value at position {len(values)} exceeded the promised bound "
                        f"|v| <= {self.max_abs_encoded} (encoded units)"
                    )
                values.append(value)
        return values

    def decrypt(
        self, private_key: PaillierPrivateKey, *, backend: Backend | None = None
    ) -> np.ndarray:
        """Decrypt, unpack and decode to float64."""
        return decode_values(self.decrypt_integers(private_key, backend=backend), self.frac_bits)

    def rerandomize(self, randomizer: Randomizer | None = None) -> PackedEncryptedVector:
        """Fresh randomness for every packed ciphertext (cheap: one per K values)."""
        source = randomizer if randomizer is not None else StandardRandomizer(self.public_key)
        if source.n != int(self.public_key.n):
            raise KeyMismatchError("the randomizer belongs to a different public key")
        square = mpz(self.public_key.n) ** 2
        obfuscators = source.obfuscators(len(self.ciphertexts))
        fresh = tuple(c * r % square for c, r in zip(self.ciphertexts, obfuscators, strict=True))
        return PackedEncryptedVector(
            self.public_key, fresh, self.length, self.frac_bits, self.max_abs_encoded, fresh=True
        )

    def to_wire(self, *, randomizer: Randomizer | None = None) -> dict[str, Any]:
        """Plain-Python message; re-randomizes first (packing derives randomness from inputs)."""
        packed = self if self.fresh else self.rerandomize(randomizer)
        return {
            "format": WIRE_FORMAT,
            "version": WIRE_VERSION,
            "key_fingerprint": public_key_fingerprint(self.public_key),
            "length": self.length,
            "frac_bits": self.frac_bits,
            "max_abs_encoded": self.max_abs_encoded,
            "ciphertexts": [int(c) for c in packed.ciphertexts],
        }

    @classmethod
    def from_wire(
        cls, public_key: PaillierPublicKey, message: dict[str, Any]
    ) -> PackedEncryptedVector:
        """Validate and load a :meth:`to_wire` message."""
        if not isinstance(message, dict) or message.get("format") != WIRE_FORMAT:
            raise WireFormatError(f"expected a {WIRE_FORMAT!r} message")
        if message.get("version") != WIRE_VERSION:
            raise WireFormatError(f"unsupported packed-vector version {message.get('version')!r}")
        if message.get("key_fingerprint") != public_key_fingerprint(public_key):
            raise KeyMismatchError("message was packed under a different public key")
        fields = {name: message.get(name) for name in ("length", "frac_bits", "max_abs_encoded")}
        for name, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise WireFormatError(f"message field {name!r} must be a non-negative int")
        layout = PackingLayout.for_bound(public_key.n, fields["max_abs_encoded"])
        ciphertexts = message.get("ciphertexts")
        expected = -(-fields["length"] // layout.slots_per_ciphertext)
        if not isinstance(ciphertexts, list) or len(ciphertexts) != expected:
            raise WireFormatError(f"message must carry {expected} packed ciphertexts")
        checked = EncryptedVector(public_key, ciphertexts, 0)  # validates the range
        return cls(
            public_key,
            tuple(checked.ciphertexts),
            fields["length"],
            validate_frac_bits(fields["frac_bits"]),
            fields["max_abs_encoded"],
            fresh=True,
        )


def pack(
    vector: EncryptedVector, *, max_abs_value: float, backend: Backend | None = None
) -> PackedEncryptedVector:
    """Pack ``vector`` whose elements are promised to satisfy |value| <= ``max_abs_value``.

    The bound is in real units (decoded with the vector's ``frac_bits``). A value beyond it is
    reported at decryption as long as it stays below the slot's guard band (about 2 to 4 times
    the bound); larger violations can corrupt neighbouring slots undetected, so the bound must
    come from an argument (e.g. ``check_sum_of_products_fits``), not a guess.
    """
    bound = value_bound_to_integer(max_abs_value, vector.frac_bits)
    layout = PackingLayout.for_bound(vector.public_key.n, bound)
    ciphertexts = vector.ciphertexts
    groups = [
        ciphertexts[start : start + layout.slots_per_ciphertext]
        for start in range(0, len(ciphertexts), layout.slots_per_ciphertext)
    ]
    runner = backend or SERIAL
    bounds = chunk_bounds(len(groups), max(1, min(runner.parallelism, len(groups))))
    n = int(vector.public_key.n)
    chunks = runner.run(
        kernels.pack_chunk,
        [(n, layout.slot_bits, layout.offset, groups[a:b]) for a, b in bounds],
        sensitive=False,
    )
    packed = tuple(mpz(c) for chunk in chunks for c in chunk)
    return PackedEncryptedVector(vector.public_key, packed, len(vector), vector.frac_bits, bound)


def packing_capacity(public_key: PaillierPublicKey, value_bits: int) -> int:
    """How many values with |v| < 2**value_bits (encoded units) fit one ciphertext."""
    return PackingLayout.for_key(public_key.n, value_bits).slots_per_ciphertext
