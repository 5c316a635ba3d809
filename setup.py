"""Build hook for the optional C kernel (everything else is declared in pyproject.toml).

``core.paillier._montgomery`` speeds up Paillier's modular multiplications (see
core/paillier/native.py). It is optional: where no C compiler is available the install still
succeeds and the gmpy2 code runs instead.
"""

import sys

from setuptools import Extension, setup

_FLAGS = [] if sys.platform == "win32" else ["-O3", "-Wall", "-Wextra"]

setup(
    ext_modules=[
        Extension(
            "core.paillier._montgomery",
            sources=["core/paillier/_montgomery.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        )
    ]
)
