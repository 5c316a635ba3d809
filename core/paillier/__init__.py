"""The one Paillier layer of every encrypted flow (no orchestration imports).

Keys are ``phe`` key objects (:mod:`.keys` generates and serialises them); ciphertexts are
plain ints, so they decrypt with either library. Flows call :mod:`.cipher`; the randomizer
modes and their security statement are in :mod:`.randomness`.
"""

from core.paillier.decryption import CrtDecryptor
from core.paillier.errors import (
    BackendError,
    KeyFormatError,
    KeyMismatchError,
    KeySizeError,
    PaillierError,
    ShapeError,
)
from core.paillier.keys import (
    DEFAULT_KEY_BITS,
    MIN_SECURE_KEY_BITS,
    generate_keypair,
    private_key_from_dict,
    private_key_to_dict,
    public_key_fingerprint,
    public_key_from_dict,
    public_key_to_dict,
)
from core.paillier.multiexp import multiexp_columns, predicted_multiplications
from core.paillier.parallel import Backend, DaskBackend, ProcessBackend, SerialBackend
from core.paillier.randomness import (
    DEFAULT_RANDOMIZER,
    RANDOMIZER_MODES,
    FixedBaseRandomizer,
    ObfuscatorFile,
    ObfuscatorPool,
    Randomizer,
    StandardRandomizer,
    make_randomizer,
    randomizer_mode,
)

__all__ = [
    "DEFAULT_KEY_BITS",
    "DEFAULT_RANDOMIZER",
    "MIN_SECURE_KEY_BITS",
    "RANDOMIZER_MODES",
    "Backend",
    "BackendError",
    "CrtDecryptor",
    "DaskBackend",
    "FixedBaseRandomizer",
    "KeyFormatError",
    "KeyMismatchError",
    "KeySizeError",
    "ObfuscatorFile",
    "ObfuscatorPool",
    "PaillierError",
    "ProcessBackend",
    "Randomizer",
    "SerialBackend",
    "ShapeError",
    "StandardRandomizer",
    "generate_keypair",
    "make_randomizer",
    "multiexp_columns",
    "predicted_multiplications",
    "private_key_from_dict",
    "private_key_to_dict",
    "public_key_fingerprint",
    "public_key_from_dict",
    "public_key_to_dict",
    "randomizer_mode",
]
