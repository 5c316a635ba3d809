"""A safe wire format for values that cross a party boundary or sit in an artifact.

Pickle would let a malicious peer run code on the receiver, so messages and stored artifacts
use JSON with a few tagged types instead: numpy arrays (``.npy`` bytes, ``allow_pickle=False``),
raw bytes, and integers too large for JSON numbers (Paillier ciphertexts, keys). Lists of
big integers are packed as one fixed-width byte string, which keeps ciphertext vectors compact.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np

_TAG = "__privreg__"
_JSON_SAFE_INT = 2**53


class CodecError(TypeError):
    """Raised for a value the wire format refuses to carry."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _is_big_int_list(value: list[Any]) -> bool:
    return (
        len(value) > 0
        and all(type(v) is int for v in value)
        and any(abs(v) >= _JSON_SAFE_INT for v in value)
    )


def _pack_ints(values: list[int]) -> dict[str, Any]:
    negative = [v < 0 for v in values]
    width = max((abs(v).bit_length() + 7) // 8 for v in values) or 1
    blob = b"".join(abs(v).to_bytes(width, "big") for v in values)
    packed: dict[str, Any] = {_TAG: "ints", "width": width, "data": _b64(blob)}
    if any(negative):
        packed["neg"] = _b64(np.packbits(np.array(negative, dtype=bool)).tobytes())
        packed["count"] = len(values)
    return packed


def _unpack_ints(packed: dict[str, Any]) -> list[int]:
    width = packed["width"]
    blob = _unb64(packed["data"])
    values = [int.from_bytes(blob[i : i + width], "big") for i in range(0, len(blob), width)]
    if "neg" in packed:
        bits = np.unpackbits(np.frombuffer(_unb64(packed["neg"]), dtype=np.uint8))
        values = [-v if bits[i] else v for i, v in enumerate(values)]
    return values


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, bool | str | float):
        return value
    if isinstance(value, int):
        if abs(value) >= _JSON_SAFE_INT:
            return {_TAG: "int", "hex": hex(value)}
        return value
    if isinstance(value, np.generic):
        return _encode(value.item())
    if isinstance(value, bytes | bytearray):
        return {_TAG: "bytes", "data": _b64(bytes(value))}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise CodecError("object arrays are not carried; convert to a list of ints or floats")
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return {_TAG: "ndarray", "data": _b64(buffer.getvalue())}
    if isinstance(value, list | tuple):
        items = list(value)
        if _is_big_int_list(items):
            return _pack_ints(items)
        return [_encode(v) for v in items]
    if isinstance(value, dict):
        if _TAG in value:
            raise CodecError(f"dict key {_TAG!r} is reserved")
        for key in value:
            if not isinstance(key, str):
                raise CodecError(f"dict keys must be str, got {type(key).__name__}")
        return {key: _encode(v) for key, v in value.items()}
    # gmpy2.mpz and other integer-like types
    if hasattr(value, "__index__"):
        return _encode(int(value))
    raise CodecError(f"cannot encode a value of type {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        tag = value.get(_TAG)
        if tag is None:
            return {key: _decode(v) for key, v in value.items()}
        if tag == "int":
            return int(value["hex"], 16)
        if tag == "ints":
            return _unpack_ints(value)
        if tag == "bytes":
            return _unb64(value["data"])
        if tag == "ndarray":
            return np.load(io.BytesIO(_unb64(value["data"])), allow_pickle=False)
        raise CodecError(f"unknown tag {tag!r}")
    return value


def dumps(value: Any) -> bytes:
    """Serialise ``value`` to bytes; raises :class:`CodecError` for unsupported types."""
    return json.dumps(_encode(value), separators=(",", ":"), allow_nan=True).encode("utf-8")


def loads(data: bytes) -> Any:
    """Inverse of :func:`dumps`; never executes code from ``data``."""
    return _decode(json.loads(data.decode("utf-8")))
