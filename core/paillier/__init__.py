"""Fast Paillier layer shared by all encrypted flows (no orchestration imports).

Compatible with ``phe``: keys are phe key objects and ciphertext integers decrypt with either
library. Main entry points: :func:`generate_keypair`, :class:`EncryptedVector`,
:func:`pack`, the randomizers and the execution backends.
"""

from core.paillier.decryption import CrtDecryptor
from core.paillier.encoding import (
    MULTIPLIER_FRAC_BITS,
    VALUE_FRAC_BITS,
    EncodedMatrix,
    check_sum_of_products_fits,
    decode_values,
    encode_matrix,
    encode_values,
    from_plaintext,
    max_safe_magnitude,
    to_plaintext,
    value_bound_to_integer,
)
from core.paillier.errors import (
    BackendError,
    EncodingError,
    KeyFormatError,
    KeyMismatchError,
    KeySizeError,
    PackingError,
    PaillierError,
    PaillierOverflowError,
    ShapeError,
    WireFormatError,
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
from core.paillier.packing import PackedEncryptedVector, PackingLayout, pack, packing_capacity
from core.paillier.parallel import Backend, DaskBackend, ProcessBackend, SerialBackend
from core.paillier.randomness import (
    DJNRandomizer,
    ObfuscatorPool,
    Randomizer,
    StandardRandomizer,
)
from core.paillier.vector import EncryptedVector

__all__ = [
    "DEFAULT_KEY_BITS",
    "MIN_SECURE_KEY_BITS",
    "MULTIPLIER_FRAC_BITS",
    "VALUE_FRAC_BITS",
    "Backend",
    "BackendError",
    "CrtDecryptor",
    "DJNRandomizer",
    "DaskBackend",
    "EncodedMatrix",
    "EncodingError",
    "EncryptedVector",
    "KeyFormatError",
    "KeyMismatchError",
    "KeySizeError",
    "ObfuscatorPool",
    "PackedEncryptedVector",
    "PackingError",
    "PackingLayout",
    "PaillierError",
    "PaillierOverflowError",
    "ProcessBackend",
    "Randomizer",
    "SerialBackend",
    "ShapeError",
    "StandardRandomizer",
    "WireFormatError",
    "check_sum_of_products_fits",
    "decode_values",
    "encode_matrix",
    "encode_values",
    "from_plaintext",
    "generate_keypair",
    "max_safe_magnitude",
    "multiexp_columns",
    "pack",
    "packing_capacity",
    "predicted_multiplications",
    "private_key_from_dict",
    "private_key_to_dict",
    "public_key_fingerprint",
    "public_key_from_dict",
    "public_key_to_dict",
    "to_plaintext",
    "value_bound_to_integer",
]
