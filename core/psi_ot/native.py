"""The optional C kernel (``core.psi_ot._band``) of the VOLE-based PSI's sequential loops.

Why: the banded OKVS is solved by Gaussian elimination row after row, and each decode XORs a
data-dependent set of about 64 table entries; numpy cannot vectorise the first and pays 128
passes for the second. The kernel does both, the expand-accumulate code's gather-XOR and the
table products by ``Delta`` (16 numpy gathers per element otherwise), with the GIL released.
It is built by ``pip install -e .`` where a C compiler is present; without it (or with
``PRIVREG_PURE_PYTHON=1``) the Python/numpy twins in :mod:`.okvs`, :mod:`.vole` and
:mod:`.gf128` run and give the same bytes. :func:`set_enabled` switches paths in-process
(tests, benchmarks).
"""

from __future__ import annotations

import os
from types import ModuleType

PURE_PYTHON_VARIABLE = "PRIVREG_PURE_PYTHON"

_built: ModuleType | None = None
if os.environ.get(PURE_PYTHON_VARIABLE, "") not in ("1", "true", "yes"):
    try:
        from core.psi_ot import _band as _built
    except ImportError:  # not built (no compiler at install time): the numpy path runs
        _built = None

_enabled = _built is not None


def kernel() -> ModuleType | None:
    """The C kernel when built and enabled, else ``None`` (the numpy path)."""
    return _built if _enabled else None


def available() -> bool:
    """Whether the kernel was built and may be imported in this process."""
    return _built is not None


def set_enabled(enabled: bool) -> bool:
    """Use the kernel (when built) or the numpy path from now on; returns the previous."""
    global _enabled
    previous = _enabled
    _enabled = enabled and _built is not None
    return previous
