"""Canonical form of row ids, shared by validation and private set intersection.

The rule (documented in docs/data.md, "How ids are matched"): an id is compared as text.

* integers (Python or numpy) become their decimal text: ``7`` -> ``"7"``;
* floats are accepted only when integral (CSV readers sometimes produce ``7.0``) and become
  the integer's text; ``7.5`` is refused;
* strings are Unicode NFC-normalised and stripped of surrounding white space; nothing else
  changes, so case and leading zeros matter;
* null, NaN, booleans, bytes and empty strings are refused.

Hence ``7`` and ``"7"`` match, ``7`` and ``"07"`` do not, and ``"é"`` typed as one code point
matches ``"é"`` typed as ``e`` plus a combining accent.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import unicodedata
from collections.abc import Iterable


class IdError(ValueError):
    """An id that has no canonical form."""


def canonical_id(value: object) -> bytes:
    """Return the UTF-8 bytes of ``value``'s canonical text."""
    kind = type(value)
    if kind is str and value.isascii():  # fast path (the same rule): ASCII is already NFC
        text = value.strip()
        if text:
            return text.encode("ascii")
    elif kind is int:  # fast path: an exact int (bool is its own type)
        return str(value).encode("ascii")
    if value is None:
        raise IdError("id is null")
    if isinstance(value, bool):
        raise IdError(f"boolean id {value!r} is ambiguous")
    if isinstance(value, numbers.Integral):
        return str(int(value)).encode("ascii")
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isnan(number):
            raise IdError("id is null (NaN)")
        if not math.isfinite(number) or not number.is_integer():
            raise IdError(f"float id {value!r} is not an integer")
        return str(int(number)).encode("ascii")
    if isinstance(value, str):
        text = unicodedata.normalize("NFC", value).strip()
        if not text:
            raise IdError("id is an empty string")
        return text.encode("utf-8")
    raise IdError(f"id of type {type(value).__name__} is not supported (use int or str)")


def id_order_digest(salt: str, ids: Iterable[object]) -> str:
    """SHA-256 of the canonical ids in row order, salted (e.g. with the job id).

    Two parties compare digests to check that their tables hold the same rows in the same
    order (PSI-aligned) without showing each other an id; equal digests mean aligned tables.
    """
    digest = hashlib.sha256(salt.encode() + b"\x00")
    for value in ids:
        digest.update(canonical_id(value) + b"\x00")
    return digest.hexdigest()


def require_aligned(
    own: str, theirs: object, party: str, peer: str, error: type[Exception] = ValueError
) -> None:
    """Raise ``error`` naming both parties unless ``peer``'s id-order digest equals this
    party's own (the comparison reveals only equal or not)."""
    if theirs != own:
        raise error(
            f"tables of {party} and {peer} are not aligned (different ids or order); run "
            "psi_align first and use the *_aligned tables"
        )
