"""Build hooks: the optional C kernel and the demo's files (the rest is in pyproject.toml).

``core.paillier._montgomery`` speeds up Paillier's modular multiplications (see
core/paillier/native.py). It is optional: where no C compiler is available the install still
succeeds and the gmpy2 code runs instead. ``core.psi_ot._band`` likewise runs the sequential
loops of the VOLE-based PSI (banded OKVS, code expansion; see core/psi_ot/native.py), with a
numpy fallback.

The demo (``jobs/demo.json``, its sub-job files and every source they name) lives outside the
packages, where ``make demo`` reads it; a wheel carries a copy as ``privreg/demo_data`` for
``privreg demo``. Which files: ``privreg.bundled.demo_files``, loaded by path (a build
environment has none of privreg's dependencies), so a source the job files name but the tree
lacks fails the build.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

_FLAGS = [] if sys.platform == "win32" else ["-O3", "-Wall", "-Wextra"]


def _bundled():
    """privreg/bundled.py of this tree, imported without the privreg package."""
    spec = importlib.util.spec_from_file_location("_privreg_bundled", "privreg/bundled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithDemo(build_py):
    """build_py, then the demo's files copied into the built privreg package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's own files
            return
        bundled = _bundled()
        target = os.path.join(self.build_lib, "privreg", bundled.PACKAGED)
        for relative in bundled.demo_files(Path()):
            destination = os.path.join(target, *relative.split("/"))
            self.mkpath(os.path.dirname(destination))
            self.copy_file(relative, destination)


setup(
    cmdclass={"build_py": BuildWithDemo},
    ext_modules=[
        Extension(
            "core.paillier._montgomery",
            sources=["core/paillier/_montgomery.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        ),
        Extension(
            "core.psi_ot._band",
            sources=["core/psi_ot/_band.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        ),
    ],
)
