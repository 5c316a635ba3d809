"""A safe, compact binary wire format for values that cross a party boundary or sit in an artifact.

Pickle would let a malicious peer run code on the receiver, so messages and stored artifacts
use a small tag-length-value format instead: ``None``, booleans, integers of any size (up to a
cap), finite floats, strings, bytes, lists, string-keyed dicts, numpy arrays of plain numeric
dtypes (raw little-endian bytes after a shape header) and lists of integers packed as one
fixed-width byte string (Paillier ciphertext vectors: no base64, no JSON).

The reader trusts nothing: every length is checked against the bytes that remain before
anything is allocated, and :class:`Limits` refuses what a receiver cannot safely hold
(non-finite floats, integers above a bit cap, duplicate dict keys, deep nesting, messages
above a size cap). A refusal raises :class:`CodecError` and returns nothing.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"PRV1"
BOUND_MAGIC = b"PRB1"
"""A message bound to a job's agreed terms: this magic, the terms' SHA-256 (32 bytes), then
the value as after :data:`MAGIC`. The digest is part of the bytes the sender signs and the
receiver hashes, so it cannot be swapped without the message being refused."""
_TERMS_BYTES = 32

# one-byte tags
_NONE, _TRUE, _FALSE = b"N", b"T", b"F"
_INT, _FLOAT, _STR, _BYTES = b"i", b"f", b"s", b"b"
_LIST, _DICT, _INTS, _ARRAY = b"l", b"d", b"I", b"A"

# plain numeric dtypes only (never object, never structured); stored little-endian
_DTYPES = {
    code: np.dtype(code)
    for code in ("|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f4", "<f8")
}
_DEFAULT_MAX_BYTES = int(os.environ.get("PRIVREG_MAX_MESSAGE_BYTES", str(2**31)))


class CodecError(TypeError):
    """A value the wire format refuses to carry, or bytes it refuses to read."""


@dataclass(frozen=True)
class Limits:
    """What a reader accepts. ``allow_nonfinite`` is for a party's own artifacts only.

    The defaults hold a 4096-bit key's ``n^2`` and a 256 MB+ ciphertext vector; the size cap
    can be raised with ``PRIVREG_MAX_MESSAGE_BYTES``.
    """

    max_bytes: int = _DEFAULT_MAX_BYTES
    max_int_bits: int = 16384
    max_depth: int = 64
    allow_nonfinite: bool = False


MESSAGE = Limits()
ARTIFACT = Limits(allow_nonfinite=True)


# ---- writing ------------------------------------------------------------------------------


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _check_int(value: int, limits: Limits) -> None:
    if value.bit_length() > limits.max_int_bits:
        raise CodecError(f"integer of {value.bit_length()} bits exceeds {limits.max_int_bits}")


def _check_float(value: float, limits: Limits) -> None:
    if not limits.allow_nonfinite and not math.isfinite(value):
        raise CodecError(f"non-finite float {value!r} is not carried")


def _write(value: Any, out: list[Any], limits: Limits, depth: int) -> None:
    if depth > limits.max_depth:
        raise CodecError(f"nesting deeper than {limits.max_depth}")
    if value is None:
        out.append(_NONE)
    elif value is True or value is False:
        out.append(_TRUE if value else _FALSE)
    elif isinstance(value, int):
        _check_int(value, limits)
        magnitude = abs(value).to_bytes((abs(value).bit_length() + 7) // 8, "big")
        out += [_INT, b"\x01" if value < 0 else b"\x00", _uvarint(len(magnitude)), magnitude]
    elif isinstance(value, float):
        _check_float(value, limits)
        out += [_FLOAT, struct.pack("<d", value)]
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += [_STR, _uvarint(len(data)), data]
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        out += [_BYTES, _uvarint(len(data)), data]
    elif isinstance(value, np.ndarray):
        _write_array(value, out, limits)
    elif isinstance(value, np.generic):
        _write(value.item(), out, limits, depth)
    elif isinstance(value, list | tuple):
        items = list(value)
        if items and all(type(v) is int for v in items):
            _write_ints(items, out, limits)
            return
        out += [_LIST, _uvarint(len(items))]
        for item in items:
            _write(item, out, limits, depth + 1)
    elif isinstance(value, dict):
        out += [_DICT, _uvarint(len(value))]
        for key, item in value.items():
            if not isinstance(key, str):
                raise CodecError(f"dict keys must be str, got {type(key).__name__}")
            data = key.encode("utf-8")
            out += [_uvarint(len(data)), data]
            _write(item, out, limits, depth + 1)
    elif hasattr(value, "__index__"):  # gmpy2.mpz and other integer-like types
        _write(int(value), out, limits, depth)
    else:
        raise CodecError(f"cannot encode a value of type {type(value).__name__}")


def _write_ints(values: list[int], out: list[Any], limits: Limits) -> None:
    width = max((abs(v).bit_length() + 7) // 8 for v in values) or 1
    if width * 8 > limits.max_int_bits + 7:
        raise CodecError(f"integer of more than {limits.max_int_bits} bits in a list")
    negative = [v < 0 for v in values]
    out += [_INTS, _uvarint(len(values)), _uvarint(width)]
    if any(negative):
        out += [b"\x01", np.packbits(np.array(negative, dtype=bool)).tobytes()]
    else:
        out.append(b"\x00")
    out.append(b"".join(abs(v).to_bytes(width, "big") for v in values))


def _write_array(value: np.ndarray, out: list[Any], limits: Limits) -> None:
    dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
    code = dtype.str
    if code not in _DTYPES:
        raise CodecError(
            f"arrays of dtype {value.dtype} are not carried; convert to ints, floats or bools"
        )
    if dtype.kind == "f" and not limits.allow_nonfinite and not np.isfinite(value).all():
        raise CodecError("array holds non-finite values (NaN or infinity), which are not carried")
    out += [_ARRAY, code.encode("ascii"), _uvarint(value.ndim)]
    out += [_uvarint(dim) for dim in value.shape]
    # a byte view, not a copy: the one copy is the final join
    out.append(np.ascontiguousarray(value, dtype=dtype).reshape(-1).view(np.uint8))


def dumps(value: Any, limits: Limits = MESSAGE, terms: str | None = None) -> bytes:
    """Serialise ``value``; raises :class:`CodecError` for what a reader would refuse.

    ``terms`` (a SHA-256 hex digest) binds the message to a job's agreed terms
    (:func:`bound_terms` reads it back)."""
    if terms is None:
        parts: list[Any] = [MAGIC]
    else:
        binding = bytes.fromhex(terms)
        if len(binding) != _TERMS_BYTES:
            raise CodecError(f"terms digest must be {_TERMS_BYTES} bytes, got {len(binding)}")
        parts = [BOUND_MAGIC, binding]
    _write(value, parts, limits, 0)
    data = b"".join(parts)
    if len(data) > limits.max_bytes:
        raise CodecError(f"message of {len(data)} bytes exceeds the cap of {limits.max_bytes}")
    return data


# ---- reading ------------------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes | memoryview, limits: Limits) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.limits = limits

    def take(self, size: int) -> memoryview:
        if size < 0 or size > len(self.data) - self.pos:
            raise CodecError(
                f"length {size} at byte {self.pos} runs past the end of the message "
                f"({len(self.data) - self.pos} bytes remain)"
            )
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise CodecError(f"length field at byte {self.pos} is too long")

    def text(self) -> str:
        try:
            return str(self.take(self.uvarint()), "utf-8")
        except UnicodeDecodeError as error:
            raise CodecError(f"invalid UTF-8 string before byte {self.pos}") from error

    def value(self, depth: int) -> Any:
        if depth > self.limits.max_depth:
            raise CodecError(f"nesting deeper than {self.limits.max_depth}")
        tag = bytes(self.take(1))
        if tag == _NONE:
            return None
        if tag in (_TRUE, _FALSE):
            return tag == _TRUE
        if tag == _INT:
            sign = self.take(1)[0]
            size = self.uvarint()
            self._check_width(size)
            magnitude = int.from_bytes(self.take(size), "big")
            if sign > 1:
                raise CodecError(f"bad sign byte {sign} before byte {self.pos}")
            return -magnitude if sign else magnitude
        if tag == _FLOAT:
            (number,) = struct.unpack("<d", self.take(8))
            if not self.limits.allow_nonfinite and not math.isfinite(number):
                raise CodecError(f"non-finite float {number!r} before byte {self.pos}")
            return number
        if tag == _STR:
            return self.text()
        if tag == _BYTES:
            return bytes(self.take(self.uvarint()))
        if tag == _LIST:
            count = self._count(self.uvarint(), 1)
            return [self.value(depth + 1) for _ in range(count)]
        if tag == _DICT:
            count = self._count(self.uvarint(), 2)
            result: dict[str, Any] = {}
            for _ in range(count):
                key = self.text()
                if key in result:
                    raise CodecError(f"duplicate dict key {key!r} before byte {self.pos}")
                result[key] = self.value(depth + 1)
            return result
        if tag == _INTS:
            return self._ints()
        if tag == _ARRAY:
            return self._array()
        raise CodecError(f"unknown tag {tag!r} at byte {self.pos - 1}")

    def _count(self, count: int, min_item_bytes: int) -> int:
        if count * min_item_bytes > len(self.data) - self.pos:
            raise CodecError(f"a header claims {count} items, more than the message holds")
        return count

    def _check_width(self, width: int) -> None:
        if width * 8 > self.limits.max_int_bits + 7:
            raise CodecError(
                f"integer width of {width} bytes exceeds {self.limits.max_int_bits} bits"
            )

    def _ints(self) -> list[int]:
        count, width = self.uvarint(), self.uvarint()
        if width < 1:
            raise CodecError(f"integer list with width {width} before byte {self.pos}")
        self._check_width(width)
        self._count(count, width)
        flag = self.take(1)[0]
        if flag > 1:
            raise CodecError(f"bad sign flag {flag} before byte {self.pos}")
        signs = None
        if flag:
            bits = np.frombuffer(self.take((count + 7) // 8), dtype=np.uint8)
            signs = np.unpackbits(bits)[:count].astype(bool).tolist()
        blob = bytes(self.take(count * width))
        values = [int.from_bytes(blob[i : i + width], "big") for i in range(0, len(blob), width)]
        if signs is not None:
            values = [-v if s else v for v, s in zip(values, signs, strict=True)]
        return values

    def _array(self) -> np.ndarray:
        code = str(self.take(3), "ascii", errors="replace")
        dtype = _DTYPES.get(code)
        if dtype is None:
            raise CodecError(f"array dtype {code!r} is not carried")
        ndim = self.uvarint()
        if ndim > 32:
            raise CodecError(f"array of {ndim} dimensions")
        shape = tuple(self.uvarint() for _ in range(ndim))
        count = math.prod(shape)
        if count * dtype.itemsize > len(self.data) - self.pos:
            raise CodecError(
                f"array header claims {count} elements of {dtype.itemsize} bytes; "
                f"only {len(self.data) - self.pos} bytes remain"
            )
        array = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).reshape(shape)
        if dtype.kind == "f" and not self.limits.allow_nonfinite and not np.isfinite(array).all():
            raise CodecError(
                "array holds non-finite values (NaN or infinity), which are not carried"
            )
        return array.astype(dtype.newbyteorder("="), copy=True)


def loads(data: bytes | memoryview, limits: Limits = MESSAGE) -> Any:
    """Inverse of :func:`dumps`; never runs code from ``data``, refuses what it cannot read."""
    if len(data) > limits.max_bytes:
        raise CodecError(f"message of {len(data)} bytes exceeds the cap of {limits.max_bytes}")
    reader = _Reader(data, limits)
    reader.pos = _body_start(data)
    value = reader.value(0)
    if reader.pos != len(reader.data):
        raise CodecError(f"{len(reader.data) - reader.pos} trailing bytes after the value")
    return value


def bound_terms(data: bytes | memoryview) -> str | None:
    """The terms digest a message is bound to (hex), ``None`` for an unbound message."""
    if _body_start(data) == len(MAGIC):
        return None
    return bytes(data[len(BOUND_MAGIC) : len(BOUND_MAGIC) + _TERMS_BYTES]).hex()


def _body_start(data: bytes | memoryview) -> int:
    head = bytes(data[: len(MAGIC)])
    if head == MAGIC:
        return len(MAGIC)
    if head == BOUND_MAGIC and len(data) >= len(BOUND_MAGIC) + _TERMS_BYTES:
        return len(BOUND_MAGIC) + _TERMS_BYTES
    raise CodecError(
        "not a privreg message (bad magic); values stored before the binary format "
        "(privreg's JSON codec) are not read: re-create them, e.g. re-run the job"
    )
