"""Bit-matrix transpose, the data movement at the heart of IKNP-style OT extension.

A matrix of ``r`` rows and ``8 c`` bit columns is stored as ``(r, c)`` uint8, bit ``j`` of row
``i`` being ``(m[i, j // 8] >> (j % 8)) & 1``. The transpose works on 8x8 bit blocks packed in
uint64 words, each transposed by three delta swaps (a standard bit trick), all vectorised.
"""

from __future__ import annotations

import numpy as np

_SWAPS = (
    (7, np.uint64(0x00AA00AA00AA00AA)),
    (14, np.uint64(0x0000CCCC0000CCCC)),
    (28, np.uint64(0x00000000F0F0F0F0)),
)


def transpose(matrix: np.ndarray) -> np.ndarray:
    """The ``(8 c, r / 8)`` transpose of an ``(r, c)`` bit matrix; ``r`` must divide by 8."""
    rows, cols = matrix.shape
    if rows % 8:
        raise ValueError(f"the row count {rows} must be a multiple of 8")
    blocks = np.array(matrix.reshape(rows // 8, 8, cols).transpose(2, 0, 1), order="C")
    words = blocks.view("<u8").reshape(cols, rows // 8)
    for shift, mask in _SWAPS:
        step = np.uint64(shift)
        t = (words ^ (words >> step)) & mask
        words ^= t ^ (t << step)
    out = words.view(np.uint8).reshape(cols, rows // 8, 8).transpose(0, 2, 1)
    return np.ascontiguousarray(out).reshape(8 * cols, rows // 8)
