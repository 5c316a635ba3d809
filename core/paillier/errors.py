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


class PeerKeyError(PaillierError):
    """A peer's public key fails the checks made before anything is encrypted under it."""


class KeyMismatchError(PaillierError):
    """Ciphertexts under different public keys were combined."""


class ShapeError(PaillierError):
    """Operand lengths or matrix shapes do not fit together."""


class BackendError(PaillierError):
    """A parallel backend was asked to do something it is not configured for."""
