"""Error types of the Paillier layer.

Every error is a ``ValueError`` subclass so that callers validating untrusted input (keys
or ciphertexts received from another organisation) can catch one family of exceptions.
"""

from __future__ import annotations


class PaillierError(ValueError):
    """Base class: bad input or misuse of the Paillier layer."""


class KeySizeError(PaillierError):
    """A key length is too short to be secure, or is not a usable size at all."""


class KeyFormatError(PaillierError):
    """A serialised key is malformed or internally inconsistent."""


class KeyMismatchError(PaillierError):
    """Ciphertexts under different public keys were combined."""


class EncodingError(PaillierError):
    """A value cannot be represented in the fixed-point encoding (NaN, inf, too large)."""


class PaillierOverflowError(PaillierError):
    """A (possibly homomorphically computed) value left the safely decodable range.

    Raised instead of silently returning a wrapped-around number modulo ``n``.
    """


class ShapeError(PaillierError):
    """Operand lengths or matrix shapes do not fit together."""


class WireFormatError(PaillierError):
    """A message received from another party does not have the expected structure."""


class PackingError(PaillierError):
    """Values cannot be packed with the requested layout."""


class BackendError(PaillierError):
    """A parallel backend was asked to do something it is not configured for."""
