"""EncryptedVector: a vector of Paillier ciphertexts with its fixed-point scale.

Plaintext i is round(value_i * 2**frac_bits) (see ``encoding``). Every operation returns a
new vector whose ``frac_bits`` says how to decode it: products add the scales of their
factors, sums first lift the lower-scaled operand exactly (multiplying by 2**difference).

Ciphertexts produced by homomorphic operations carry randomness derived from their inputs
(an all-zero column of X^T [[d]] is even the constant 1). Such vectors are marked not fresh
and :meth:`EncryptedVector.to_wire` re-randomizes them before they leave the process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from gmpy2 import mpz
from numpy.typing import ArrayLike
from phe.paillier import EncryptedNumber, PaillierPrivateKey, PaillierPublicKey

from core.paillier import kernels
from core.paillier.encoding import (
    MULTIPLIER_FRAC_BITS,
    VALUE_FRAC_BITS,
    EncodedMatrix,
    check_sum_of_products_fits,
    decode_values,
    encode_matrix,
    encode_values,
    from_plaintext,
    to_plaintext,
    validate_frac_bits,
    value_bound_to_integer,
)
from core.paillier.errors import (
    EncodingError,
    KeyMismatchError,
    PaillierError,
    ShapeError,
    WireFormatError,
)
from core.paillier.keys import public_key_fingerprint
from core.paillier.parallel import SERIAL, Backend, chunk_bounds
from core.paillier.randomness import Randomizer, StandardRandomizer

WIRE_FORMAT = "privreg.paillier.vector"
WIRE_VERSION = 1
_MIN_ROWS_PER_CHUNK = 64  # X^T [[d]]: about two multiplications per row and column
_MIN_ITEMS_PER_CHUNK = 4  # exponentiations and decryptions: milliseconds per item
_PHE_LOG2_BASE = 4  # phe's EncodedNumber uses BASE = 16


class EncryptedVector:
    """Ciphertexts (gmpy2 ints) under one public key, decoded with ``frac_bits``."""

    __slots__ = ("_ciphertexts", "_frac_bits", "_fresh", "_n", "_n_square", "_public_key")
    __array_ufunc__ = None  # make numpy defer to our reflected operators

    def __init__(
        self,
        public_key: PaillierPublicKey,
        ciphertexts: Iterable[int | mpz],
        frac_bits: int,
        *,
        fresh: bool = False,
    ) -> None:
        if not isinstance(public_key, PaillierPublicKey):
            raise PaillierError(
                f"public_key must be a phe PaillierPublicKey, got {type(public_key).__name__}"
            )
        self._public_key = public_key
        self._n = mpz(public_key.n)
        self._n_square = self._n * self._n
        self._frac_bits = validate_frac_bits(frac_bits)
        self._ciphertexts = [mpz(c) for c in ciphertexts]
        for position, ciphertext in enumerate(self._ciphertexts):
            if not 0 < ciphertext < self._n_square:
                raise PaillierError(f"ciphertext at position {position} is not in (0, n^2)")
        self._fresh = fresh

    def _derive(
        self, ciphertexts: list[mpz], frac_bits: int, *, fresh: bool = False
    ) -> EncryptedVector:
        """Build a result vector without re-validating ciphertexts we computed ourselves."""
        result = object.__new__(EncryptedVector)
        result._public_key = self._public_key
        result._n, result._n_square = self._n, self._n_square
        result._ciphertexts = ciphertexts
        result._frac_bits = frac_bits
        result._fresh = fresh
        return result

    # ------------------------------------------------------------------ encryption
    @classmethod
    def encrypt(
        cls,
        public_key: PaillierPublicKey,
        values: ArrayLike,
        *,
        frac_bits: int = VALUE_FRAC_BITS,
        randomizer: Randomizer | None = None,
        backend: Backend | None = None,
    ) -> EncryptedVector:
        """Encrypt a 1-D array of reals with ``frac_bits`` fractional bits."""
        return cls.encrypt_encoded(
            public_key,
            encode_values(values, frac_bits),
            frac_bits=frac_bits,
            randomizer=randomizer,
            backend=backend,
        )

    @classmethod
    def encrypt_encoded(
        cls,
        public_key: PaillierPublicKey,
        integers: Sequence[int],
        *,
        frac_bits: int,
        randomizer: Randomizer | None = None,
        backend: Backend | None = None,
    ) -> EncryptedVector:
        """Encrypt already encoded signed integers (value * 2**frac_bits)."""
        vector = cls(public_key, [], frac_bits)
        n = vector._n
        plaintexts = [to_plaintext(int(v), int(n), position=i) for i, v in enumerate(integers)]
        obfuscators = vector._obfuscators(len(plaintexts), randomizer, backend)
        square = vector._n_square
        vector._ciphertexts = [
            (1 + n * m) * r % square for m, r in zip(plaintexts, obfuscators, strict=True)
        ]
        vector._fresh = True
        return vector

    def _obfuscators(
        self, count: int, randomizer: Randomizer | None, backend: Backend | None
    ) -> list[mpz]:
        source = randomizer if randomizer is not None else StandardRandomizer(self._public_key)
        if source.n != self._n:
            raise KeyMismatchError("the randomizer belongs to a different public key")
        return source.obfuscators(count, backend=backend)

    def rerandomize(
        self, randomizer: Randomizer | None = None, *, backend: Backend | None = None
    ) -> EncryptedVector:
        """Same plaintexts, fresh randomness: safe to hand to another party."""
        obfuscators = self._obfuscators(len(self), randomizer, backend)
        square = self._n_square
        fresh = [c * r % square for c, r in zip(self._ciphertexts, obfuscators, strict=True)]
        return self._derive(fresh, self._frac_bits, fresh=True)

    # ------------------------------------------------------------------ accessors
    @property
    def public_key(self) -> PaillierPublicKey:
        return self._public_key

    @property
    def frac_bits(self) -> int:
        return self._frac_bits

    @property
    def is_fresh(self) -> bool:
        """True if every ciphertext carries fresh randomness (straight from encryption)."""
        return self._fresh

    @property
    def ciphertexts(self) -> list[mpz]:
        """A copy of the ciphertext list."""
        return list(self._ciphertexts)

    def __len__(self) -> int:
        return len(self._ciphertexts)

    def __repr__(self) -> str:
        return (
            f"EncryptedVector(len={len(self)}, frac_bits={self._frac_bits}, "
            f"key={public_key_fingerprint(self._public_key)[:12]}, fresh={self._fresh})"
        )

    def __getitem__(self, key: int | slice | Sequence[int] | np.ndarray) -> EncryptedVector:
        """Sub-vector by index, slice, integer array or boolean mask (always a vector)."""
        if isinstance(key, slice):
            selected = self._ciphertexts[key]
        elif isinstance(key, int | np.integer):
            index = int(key)
            if not -len(self) <= index < len(self):
                raise IndexError(f"index {index} out of range for length {len(self)}")
            selected = [self._ciphertexts[index]]
        else:
            indices = self._indices(key)
            selected = [self._ciphertexts[i] for i in indices.tolist()]
        return self._derive(selected, self._frac_bits, fresh=self._fresh)

    def _indices(self, key: ArrayLike) -> np.ndarray:
        array = np.asarray(key)
        if array.dtype == bool:
            if array.shape != (len(self),):
                raise ShapeError(f"boolean mask of shape {array.shape} for length {len(self)}")
            return np.flatnonzero(array)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ShapeError("an index must be an int, a slice, an int array or a boolean mask")
        if array.size and (array.min() < -len(self) or array.max() >= len(self)):
            raise IndexError(f"index out of range for length {len(self)}")
        return np.where(array < 0, array + len(self), array)

    @classmethod
    def concat(cls, vectors: Sequence[EncryptedVector]) -> EncryptedVector:
        """Concatenate vectors under the same key (scales lifted to the largest one)."""
        if not vectors:
            raise ShapeError("concat needs at least one vector")
        first = vectors[0]
        target = max(v._frac_bits for v in vectors)
        parts: list[mpz] = []
        for vector in vectors:
            first._require_same_key(vector)
            parts.extend(vector._lifted_to(target))
        return first._derive(parts, target, fresh=all(v._fresh for v in vectors))

    # ------------------------------------------------------------------ scale handling
    def with_frac_bits(self, frac_bits: int) -> EncryptedVector:
        """Exactly re-express with more fractional bits (multiplies plaintexts by 2**diff)."""
        validate_frac_bits(frac_bits)
        if frac_bits < self._frac_bits:
            raise EncodingError(
                f"cannot lower the scale from {self._frac_bits} to {frac_bits} fractional bits "
                "homomorphically (that would need a division); decrypt first"
            )
        if frac_bits == self._frac_bits:
            return self
        return self._derive(self._lifted_to(frac_bits), frac_bits)

    def _lifted_to(self, frac_bits: int) -> list[mpz]:
        difference = frac_bits - self._frac_bits
        if difference == 0:
            return self._ciphertexts
        return kernels.scalar_power_chunk(int(self._n_square), self._ciphertexts, 1 << difference)

    def _require_same_key(self, other: EncryptedVector) -> None:
        if other._n != self._n:
            raise KeyMismatchError(
                "cannot combine ciphertexts under different public keys "
                f"({public_key_fingerprint(self._public_key)[:12]} vs "
                f"{public_key_fingerprint(other._public_key)[:12]})"
            )

    def _require_length(self, length: int, what: str) -> None:
        if length != len(self):
            raise ShapeError(f"{what} has length {length}, the encrypted vector {len(self)}")

    # ------------------------------------------------------------------ addition
    def __add__(self, other: EncryptedVector | ArrayLike) -> EncryptedVector:
        if isinstance(other, EncryptedVector):
            return self._add_encrypted(other)
        return self._add_plain(other)

    def __radd__(self, other: ArrayLike) -> EncryptedVector:
        return self._add_plain(other)

    def __neg__(self) -> EncryptedVector:
        return self._derive(
            kernels.scalar_power_chunk(int(self._n_square), self._ciphertexts, -1), self._frac_bits
        )

    def __sub__(self, other: EncryptedVector | ArrayLike) -> EncryptedVector:
        if isinstance(other, EncryptedVector):
            return self._add_encrypted(-other)
        return self._add_plain(-_as_plain_array(other))

    def __rsub__(self, other: ArrayLike) -> EncryptedVector:
        return (-self)._add_plain(other)

    def _add_encrypted(self, other: EncryptedVector) -> EncryptedVector:
        self._require_same_key(other)
        self._require_length(len(other), "the other encrypted vector")
        target = max(self._frac_bits, other._frac_bits)
        square = self._n_square
        summed = [
            a * b % square
            for a, b in zip(self._lifted_to(target), other._lifted_to(target), strict=True)
        ]
        return self._derive(summed, target)

    def _add_plain(self, values: ArrayLike) -> EncryptedVector:
        plain = self._broadcast(values)
        n, square = self._n, self._n_square
        encoded = encode_values(plain, self._frac_bits)
        summed = [
            c * ((1 + n * to_plaintext(v, int(n), position=i)) % square) % square
            for i, (c, v) in enumerate(zip(self._ciphertexts, encoded, strict=True))
        ]
        return self._derive(summed, self._frac_bits)

    def _broadcast(self, values: ArrayLike) -> np.ndarray:
        array = _as_plain_array(values)
        if array.ndim == 0:
            return np.full(len(self), array[()], dtype=array.dtype)
        self._require_length(array.shape[0], "the plain operand")
        return array

    # ------------------------------------------------------------------ multiplication
    def __mul__(self, other: ArrayLike) -> EncryptedVector:
        if isinstance(other, EncryptedVector):
            raise PaillierError("Paillier cannot multiply two ciphertexts; one must be plain")
        return self.multiply(other)

    __rmul__ = __mul__

    def __truediv__(self, divisor: float) -> EncryptedVector:
        return self.multiply(1.0 / float(divisor))

    def multiply(
        self,
        factors: ArrayLike,
        *,
        frac_bits: int | None = None,
        backend: Backend | None = None,
    ) -> EncryptedVector:
        """Multiply by a plain scalar or elementwise by a plain vector.

        Integer factors are exact (``frac_bits`` 0 unless given); real factors are encoded with
        ``frac_bits`` (default MULTIPLIER_FRAC_BITS). The result has the sum of both scales.
        """
        array = _as_plain_array(factors)
        is_integer = np.issubdtype(array.dtype, np.integer) or array.dtype == bool
        bits = validate_frac_bits(
            frac_bits if frac_bits is not None else (0 if is_integer else MULTIPLIER_FRAC_BITS)
        )
        square = int(self._n_square)
        if array.ndim == 0:
            exponent = encode_values(array.reshape(1), bits)[0]
            products = self._run_chunks(
                kernels.scalar_power_chunk,
                backend,
                lambda a, b: (square, self._shippable(backend or SERIAL, a, b), exponent),
            )
        else:
            self._require_length(array.shape[0], "the plain factor vector")
            exponents = encode_values(array, bits)
            products = self._run_chunks(
                kernels.power_chunk,
                backend,
                lambda a, b: (square, self._shippable(backend or SERIAL, a, b), exponents[a:b]),
            )
        return self._derive(products, self._frac_bits + bits)

    def _run_chunks(self, function: Any, backend: Backend | None, arguments: Any) -> list[mpz]:
        runner = backend or SERIAL
        bounds = chunk_bounds(len(self), _parallel_parts(runner, len(self)))
        chunks = runner.run(function, [arguments(a, b) for a, b in bounds], sensitive=False)
        return [mpz(c) for chunk in chunks for c in chunk]

    def _shippable(self, runner: Backend, start: int, stop: int) -> list[mpz] | list[int]:
        """Ciphertexts for one chunk; Python ints pickle ~3x faster than mpz for workers."""
        chunk = self._ciphertexts[start:stop]
        return chunk if runner.parallelism == 1 else [int(c) for c in chunk]

    # ------------------------------------------------------------------ linear algebra
    def transpose_dot(
        self,
        matrix: EncodedMatrix | ArrayLike,
        *,
        frac_bits: int = MULTIPLIER_FRAC_BITS,
        max_abs_value: float | None = None,
        backend: Backend | None = None,
    ) -> EncryptedVector:
        """X^T [[d]] for a plain matrix X (rows x k): one ciphertext per column.

        A float matrix is encoded with ``frac_bits``; pass an :class:`EncodedMatrix` to reuse
        an encoding. If ``max_abs_value`` (a bound on |d_i|, agreed between the parties) is
        given, overflow is ruled out before any work is done.
        """
        encoded = matrix if isinstance(matrix, EncodedMatrix) else encode_matrix(matrix, frac_bits)
        rows, columns = encoded.shape
        self._require_length(rows, "the matrix row count")
        if max_abs_value is not None:
            check_sum_of_products_fits(
                int(self._n),
                terms=rows,
                max_abs_multiplier=encoded.max_abs(),
                max_abs_value=value_bound_to_integer(max_abs_value, self._frac_bits),
            )
        result = self._column_products(encoded.values, columns, backend)
        return self._derive(result, self._frac_bits + encoded.frac_bits)

    def _column_products(
        self, exponents: np.ndarray, columns: int, backend: Backend | None
    ) -> list[mpz]:
        runner = backend or SERIAL
        bounds = chunk_bounds(len(self), _parallel_parts(runner, len(self), _MIN_ROWS_PER_CHUNK))
        square = int(self._n_square)
        arguments = [
            (square, self._shippable(runner, a, b), np.ascontiguousarray(exponents[a:b]))
            for a, b in bounds
        ]
        partials = runner.run(kernels.xt_dot_chunk, arguments, sensitive=False)
        totals = [mpz(1)] * columns
        for partial in partials:
            totals = [t * mpz(p) % self._n_square for t, p in zip(totals, partial, strict=True)]
        return totals

    def dot(
        self,
        values: ArrayLike,
        *,
        frac_bits: int = MULTIPLIER_FRAC_BITS,
        backend: Backend | None = None,
    ) -> EncryptedVector:
        """sum_i values_i * [[d_i]] as a length-1 vector."""
        column = _as_plain_array(values)
        if column.ndim != 1:
            raise ShapeError(f"dot expects a 1-D plain vector, got shape {column.shape}")
        return self.transpose_dot(column.reshape(-1, 1), frac_bits=frac_bits, backend=backend)

    def sum(self) -> EncryptedVector:
        """Encrypted sum of all elements (length-1 vector)."""
        total = mpz(1)
        for ciphertext in self._ciphertexts:
            total = total * ciphertext % self._n_square
        return self._derive([total], self._frac_bits)

    def subset_sums(
        self, selection: ArrayLike, *, backend: Backend | None = None
    ) -> EncryptedVector:
        """For each column of a 0/1 (or boolean) rows x k matrix, the sum of selected elements.

        This is the encrypted label-weighted sum used with binary features; the scale is
        unchanged because the multipliers are exact 0/1.
        """
        mask = np.asarray(selection)
        if mask.ndim == 1:
            mask = mask.reshape(-1, 1)
        if mask.ndim != 2:
            raise ShapeError(f"selection must be 1-D or 2-D, got shape {mask.shape}")
        if mask.dtype != bool and not np.all((mask == 0) | (mask == 1)):
            raise EncodingError("selection must contain only 0/1 or booleans")
        return self.transpose_dot(EncodedMatrix(mask.astype(np.int64), 0), backend=backend)

    def subset_sum(self, selector: ArrayLike, *, backend: Backend | None = None) -> EncryptedVector:
        """Sum of the elements picked by a boolean mask or an array of distinct indices."""
        array = np.asarray(selector)
        if array.dtype != bool:
            indices = self._indices(array)
            if np.unique(indices).size != indices.size:
                raise ShapeError("subset_sum indices must be distinct")
            array = np.zeros(len(self), dtype=bool)
            array[indices] = True
        return self.subset_sums(array, backend=backend)

    # ------------------------------------------------------------------ decryption
    def decrypt_integers(
        self, private_key: PaillierPrivateKey, *, backend: Backend | None = None
    ) -> list[int]:
        """Signed plaintext integers (value * 2**frac_bits), with overflow detection."""
        if int(private_key.public_key.n) != self._n:
            raise KeyMismatchError("the private key does not belong to this vector's public key")
        runner = backend or SERIAL
        bounds = chunk_bounds(len(self), _parallel_parts(runner, len(self)))
        p, q = int(private_key.p), int(private_key.q)
        chunks = runner.run(
            kernels.decrypt_chunk,
            [(p, q, self._shippable(runner, a, b)) for a, b in bounds],
            sensitive=True,
        )
        plaintexts = [int(m) for chunk in chunks for m in chunk]
        n = int(self._n)
        return [from_plaintext(m, n, position=i) for i, m in enumerate(plaintexts)]

    def decrypt(
        self, private_key: PaillierPrivateKey, *, backend: Backend | None = None
    ) -> np.ndarray:
        """Decrypt and decode to float64."""
        return decode_values(self.decrypt_integers(private_key, backend=backend), self._frac_bits)

    # ------------------------------------------------------------------ interchange
    def to_wire(
        self, *, randomizer: Randomizer | None = None, allow_unrandomized: bool = False
    ) -> dict[str, Any]:
        """Plain-Python message (str/int/list of int) for sending to another party.

        Vectors that came out of homomorphic operations are re-randomized first unless
        ``allow_unrandomized`` is set (only for data that never leaves this party).
        """
        vector = self if (self._fresh or allow_unrandomized) else self.rerandomize(randomizer)
        return {
            "format": WIRE_FORMAT,
            "version": WIRE_VERSION,
            "key_fingerprint": public_key_fingerprint(self._public_key),
            "frac_bits": vector._frac_bits,
            "ciphertexts": [int(c) for c in vector._ciphertexts],
        }

    @classmethod
    def from_wire(cls, public_key: PaillierPublicKey, message: dict[str, Any]) -> EncryptedVector:
        """Validate and load a :meth:`to_wire` message encrypted under ``public_key``."""
        if not isinstance(message, dict):
            raise WireFormatError(f"message must be a dict, got {type(message).__name__}")
        if message.get("format") != WIRE_FORMAT or message.get("version") != WIRE_VERSION:
            raise WireFormatError(
                f"expected format {WIRE_FORMAT!r} version {WIRE_VERSION}, got "
                f"{message.get('format')!r} version {message.get('version')!r}"
            )
        if message.get("key_fingerprint") != public_key_fingerprint(public_key):
            raise KeyMismatchError("message was encrypted under a different public key")
        frac_bits = message.get("frac_bits")
        ciphertexts = message.get("ciphertexts")
        if isinstance(frac_bits, bool) or not isinstance(frac_bits, int):
            raise WireFormatError("message field 'frac_bits' must be an int")
        if not isinstance(ciphertexts, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in ciphertexts
        ):
            raise WireFormatError("message field 'ciphertexts' must be a list of ints")
        try:
            return cls(public_key, ciphertexts, frac_bits, fresh=True)
        except (PaillierError, EncodingError) as exc:
            raise WireFormatError(f"invalid vector message: {exc}") from exc

    def to_phe(self) -> list[EncryptedNumber]:
        """Equivalent ``phe`` EncryptedNumbers (phe uses base-16 exponents, so the scale is
        first lifted to a multiple of 4 bits when needed)."""
        target = -(-self._frac_bits // _PHE_LOG2_BASE) * _PHE_LOG2_BASE
        lifted = self._lifted_to(target)
        exponent = -target // _PHE_LOG2_BASE
        return [EncryptedNumber(self._public_key, int(c), exponent) for c in lifted]

    @classmethod
    def from_phe(cls, numbers: Sequence[EncryptedNumber]) -> EncryptedVector:
        """Wrap ``phe`` EncryptedNumbers (any mix of exponents) as one vector."""
        if not numbers:
            raise ShapeError("from_phe needs at least one EncryptedNumber")
        public_key = numbers[0].public_key
        pieces = []
        for position, number in enumerate(numbers):
            if not isinstance(number, EncryptedNumber):
                raise PaillierError(f"item {position} is not a phe EncryptedNumber")
            if number.public_key != public_key:
                raise KeyMismatchError(f"item {position} is under a different public key")
            ciphertext = number.ciphertext(be_secure=False)
            bits = -number.exponent * _PHE_LOG2_BASE
            single = cls(public_key, [ciphertext], max(bits, 0))
            if bits < 0:  # positive phe exponent: the plaintext is scaled down by 16**exponent
                single = single.multiply(1 << -bits)
            pieces.append(single)
        return cls.concat(pieces)


def _as_plain_array(values: ArrayLike) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype == bool:
        array = array.astype(np.int64)
    if array.dtype == object:
        try:
            array = array.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise EncodingError("plain operands must be numbers") from exc
    if array.ndim > 1:
        raise ShapeError(f"plain operand must be a scalar or 1-D, got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise EncodingError(f"plain operands must be numbers, got dtype {array.dtype}")
    return array


def _parallel_parts(backend: Backend, length: int, minimum: int = _MIN_ITEMS_PER_CHUNK) -> int:
    """Chunks worth creating: one per worker, but none smaller than ``minimum`` items."""
    return max(1, min(backend.parallelism, length // minimum))
