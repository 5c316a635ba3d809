"""One party's labelled rows, validated once at construction.

Why here and not later: every estimator downstream assumes finite features, 0/1 labels and
a feature count the LP solver can handle; checking at the door lets errors name the party,
column and row instead of surfacing as a solver failure. Both classes are required only by
the estimators that need them (:func:`require_both_classes`): a local fit needs both classes
at its site, while the row-level release sums any site's rows, so a site that saw only one
class (a screening clinic with no cases this year) still contributes, and refusing it would
itself reveal something about its labels.

Label convention: label 1 is the paper's class 1 (mean mu1), label 0 its class 2 (mean mu2),
so the mean difference is ``mu_d = mu1 - mu2 = mean(label 1) - mean(label 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.sparse_lda.errors import (
    ColumnMismatchError,
    DimensionLimitError,
    LabelValueError,
    MissingClassError,
    NonFiniteValueError,
    ShapeError,
)

MAX_FEATURES = 2000
"""Largest supported d. The direction LP has 2d variables and 2d dense constraint rows
(4 d^2 nonzeros, about 128 MB of doubles at d = 2000), and CLIME solves d such programs,
so beyond this the solver's time and memory stop being reasonable on one machine."""

MIN_ROWS_PER_CLASS = 2
"""A class needs two rows before its within-class scatter carries any information (of a
site's rows for a local fit, of all parties' rows for a pooled one)."""

POSITIVE_LABEL = 1
NEGATIVE_LABEL = 0


@dataclass(frozen=True)
class PartyData:
    """Features (rows x columns) and 0/1 labels held by one party."""

    name: str
    features: np.ndarray
    labels: np.ndarray
    columns: tuple[str, ...]

    def __post_init__(self) -> None:
        features = np.asarray(self.features, dtype=np.float64)
        labels = np.asarray(self.labels)
        object.__setattr__(self, "features", features)
        object.__setattr__(self, "columns", tuple(self.columns))
        _check_shapes(self.name, features, labels, self.columns)
        _check_finite(self.name, features, self.columns)
        object.__setattr__(self, "labels", _checked_labels(self.name, labels))

    @property
    def n_rows(self) -> int:
        return int(self.features.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.features.shape[1])


def check_same_columns(parties: Sequence[PartyData]) -> tuple[str, ...]:
    """Return the shared column names, or say which party differs and at which column."""
    if not parties:
        raise ShapeError("no parties given: at least one party is needed")
    reference = parties[0]
    for party in parties[1:]:
        if party.columns == reference.columns:
            continue
        if len(party.columns) != len(reference.columns):
            raise ColumnMismatchError(
                f"party {party.name!r} has {len(party.columns)} columns but party "
                f"{reference.name!r} has {len(reference.columns)}"
            )
        pairs = zip(party.columns, reference.columns, strict=True)
        position = next(i for i, (mine, theirs) in enumerate(pairs) if mine != theirs)
        raise ColumnMismatchError(
            f"party {party.name!r} column {position} is {party.columns[position]!r} but party "
            f"{reference.name!r} has {reference.columns[position]!r} there; align columns first"
        )
    return reference.columns


def _check_shapes(
    name: str, features: np.ndarray, labels: np.ndarray, columns: tuple[str, ...]
) -> None:
    if features.ndim != 2:
        raise ShapeError(f"party {name!r}: features must be 2-D, got shape {features.shape}")
    n_rows, n_features = features.shape
    if labels.shape != (n_rows,):
        raise ShapeError(
            f"party {name!r}: labels must have shape ({n_rows},) to match the features, "
            f"got {labels.shape}"
        )
    if len(columns) != n_features:
        raise ShapeError(
            f"party {name!r}: {len(columns)} column names for {n_features} feature columns"
        )
    if len(set(columns)) != len(columns):
        duplicate = next(c for i, c in enumerate(columns) if c in columns[:i])
        raise ColumnMismatchError(f"party {name!r}: column name {duplicate!r} appears twice")
    if n_features > MAX_FEATURES:
        raise DimensionLimitError(
            f"party {name!r}: {n_features} features exceeds the supported maximum of "
            f"{MAX_FEATURES} for the dense LP solver; select or screen features first"
        )
    if n_features == 0:
        raise ShapeError(f"party {name!r}: no feature columns")
    if n_rows == 0:
        raise ShapeError(f"party {name!r}: no rows")


def _check_finite(name: str, features: np.ndarray, columns: tuple[str, ...]) -> None:
    bad = ~np.isfinite(features)
    if not bad.any():
        return
    row, column = np.argwhere(bad)[0]  # argwhere is row-major, so this is the first row
    raise NonFiniteValueError(
        f"party {name!r}, column {columns[column]!r}, row {row + 1} (1-based): value "
        f"{features[row, column]!r} is not finite"
    )


def _checked_labels(name: str, labels: np.ndarray) -> np.ndarray:
    allowed = np.isin(labels, (NEGATIVE_LABEL, POSITIVE_LABEL))
    if not allowed.all():
        row = int(np.flatnonzero(~allowed)[0])
        raise LabelValueError(
            f"party {name!r}, row {row + 1} (1-based): label {labels[row]!r} is not "
            f"{POSITIVE_LABEL} (class 1) or {NEGATIVE_LABEL} (class 2)"
        )
    return labels.astype(np.int8)


def require_both_classes(party: PartyData) -> None:
    """Refuse, naming the party, rows that hold fewer than two of either class."""
    for label in (POSITIVE_LABEL, NEGATIVE_LABEL):
        count = int(np.count_nonzero(party.labels == label))
        if count < MIN_ROWS_PER_CLASS:
            raise MissingClassError(
                f"party {party.name!r} has {count} rows with label {label}; a local fit needs "
                f"at least {MIN_ROWS_PER_CLASS} rows of both classes to estimate the class means"
            )
