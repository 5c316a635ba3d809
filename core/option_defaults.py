"""The job options' default values and choices, in a module that imports nothing heavy.

The job file's schema (and so ``privreg job check``) needs these constants, but the modules
that use them pull in SciPy, gmpy2 and the rest of their package; they import from here so
the values live in one place and the schema loads in a fraction of the time.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

# core.paillier.randomness: the obfuscator modes ("djn" is an alias of "short")
FULL, SHORT, STANDARD = "full", "short", "standard"
RANDOMIZER_MODES = (FULL, SHORT, STANDARD)
DEFAULT_RANDOMIZER = FULL

# core.label_dp: the label grid's largest size and the losses a regression can take
DEFAULT_GRID_SIZE = 1_000
LossName = Literal["squared", "absolute", "poisson"]
LOSS_NAMES: tuple[LossName, ...] = ("squared", "absolute", "poisson")

# core.sparse_lda: the hard threshold's and the Dantzig radius's scales
DEFAULT_THRESHOLD_SCALE = 4.0
DEFAULT_DIRECTION_RADIUS_SCALE = 3.0
"""The paper's choice: ``lambda = 3 sqrt(log d / n)``."""


class PrecisionMethod(StrEnum):
    """Which sparse precision estimator debiasing uses."""

    NODEWISE_LASSO = "nodewise_lasso"
    CLIME = "clime"


class PrivacyUnit(StrEnum):
    """What one (epsilon, delta) release protects."""

    ROW = "row"
    PARTY = "party"
