"""Chunk functions executed by the backends (serially, in worker processes or threads, or on
Dask).

Each takes only plain data -- moduli as ints, ciphertexts as gmpy2/Python ints, exponents as
int64 arrays or int lists -- and returns ints, so results are identical on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gmpy2 import mpz

from core.paillier import native
from core.paillier.multiexp import multiexp_columns


def xt_dot_chunk(
    n_square: int, ciphertexts: Sequence[int | mpz], exponents: np.ndarray
) -> list[mpz]:
    """Partial X^T [[d]] over a block of rows: one ciphertext per column."""
    return multiexp_columns([mpz(c) for c in ciphertexts], exponents, mpz(n_square))


def montgomery_path() -> str:
    """The Montgomery product the chunks run on in this process: ``ifma``, ``avx2`` or
    ``portable`` (the native kernel), or ``gmpy2`` (not built, or ``PRIVREG_PURE_PYTHON``).

    Run through a backend, it is what the workers use: each picks its product when it
    imports the kernel (the fastest its CPU has, or ``PRIVREG_MONTGOMERY_PATH`` from its
    environment), not from a parent's :func:`native.set_path`. Results are the same bit for
    bit on every product; this only says which one did the work (benchmarks, logs)."""
    return (native.current_path() if native.AVAILABLE else None) or "gmpy2"
