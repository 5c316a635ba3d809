"""Row-level DP in two rounds: select k features privately, then release only their moments.

Why two rounds. The one-round moments release (:mod:`core.sparse_lda.moments_release`) adds
noise to every one of the ``d (d + 1) / 2`` second moments and to all 2d class sums. The
noise per entry is set by the row clip radius (one row moves ``x x^T`` by at most R^2 in
Frobenius norm, whatever d), so fewer entries do not mean less noise per entry; what falls
is the total noise energy the fit has to see through (``sqrt(k)`` instead of ``sqrt(d)`` in
the noise matrix's norm, k instead of d noisy mean coordinates), and rows can be clipped in k
dimensions, where they are shorter, instead of d. This is what sparse LDA assumes anyway:
few features carry the signal.

Round 1 (selection), per party, rows clipped to ``||x|| <= R``:
``a S1 | a S0 | a n1 | a n0 | b sum_rows x (.) x`` (3d + 2 entries), summed securely with
noise shares. The coordinator computes each feature's standardised class-mean difference
``|m1_j - m0_j| / s_j`` from the noisy sum (s_j the within-class standard deviation, from the
squares) and keeps the k largest: post-processing of a DP release, so the selection costs
nothing beyond round 1's share of the budget (no separate report-noisy-max charge).

Round 2 (moments of the selected features): the one-round vector on the k selected columns
with rows clipped to ``R_k`` (``selected_clip_norm``) in those k dimensions, summed securely;
the coordinator fits the discriminant on it and puts zeros on the other d - k features.

Accounting: both rounds carry the same sigma; the weights ``a``, ``b`` give round 1 the share
``selection_budget_share`` of the squared sensitivity, and :func:`core.sparse_lda.privacy.
calibrate` sizes sigma for ``sqrt(Delta_1^2 + Delta_2^2)``: the pair is rho-zCDP with the
rho of one (epsilon, delta) release, composed adaptively (round 2's columns depend on round
1's output, its sensitivity bound does not). One ledger charge covers both rounds.

Flow. Two secure-sum sessions of the same parties: the round-1 vector, then (after the
coordinator broadcasts the k selected column indices, which are public as post-processing)
the round-2 vector. A party stores both noisy vectors with its one charge, so a retry reuses
them and is charged nothing.
"""

from __future__ import annotations

import math

import numpy as np

from core.sparse_lda.errors import ShapeError, SparseLDAInputError
from core.sparse_lda.local_fit import LocalFitSettings
from core.sparse_lda.model import LinearDiscriminant
from core.sparse_lda.moments_release import (
    NOISE_RIDGE_SCALE,
    clip_rows,
    model_from_statistics,
    statistics_vector,
)
from core.sparse_lda.party_data import NEGATIVE_LABEL, POSITIVE_LABEL, PartyData
from core.sparse_lda.privacy import PrivacySettings, round_to_grid, selection_dimension

VARIANCE_FLOOR = 1e-2
"""Floor on a feature's estimated within-class variance in the selection score (noise can
drive the estimate to or below zero); relative to standardised features' variance 1."""


def _check_two_rounds(settings: PrivacySettings) -> None:
    if not settings.two_rounds:
        raise SparseLDAInputError(
            "the selected-moments release needs row-level settings with row_mechanism "
            "'selected_moments'"
        )


def selection_vector(party: PartyData, settings: PrivacySettings) -> np.ndarray:
    """Round 1, one party's exact vector ``a S1 | a S0 | a n1 | a n0 | b q`` on the grid,
    rows clipped to ``row_clip_norm`` (q the per-feature sums of squares). The caller adds
    its noise share."""
    _check_two_rounds(settings)
    rows = clip_rows(party.features, settings.row_clip_norm)
    sums_weight, squares_weight = settings.selection_weights()
    positive = party.labels == POSITIVE_LABEL
    negative = party.labels == NEGATIVE_LABEL
    vector = np.concatenate(
        [
            sums_weight * rows[positive].sum(axis=0),
            sums_weight * rows[negative].sum(axis=0),
            sums_weight * np.array([positive.sum(), negative.sum()], dtype=np.float64),
            squares_weight * (rows * rows).sum(axis=0),
        ]
    )
    return round_to_grid(vector, settings.grid_granularity)


def selection_norm_bound(n_rows: int, settings: PrivacySettings, n_features: int) -> float:
    """Largest L2 norm an honest party's round-1 vector can have: each row adds at most
    ``R a`` to the sums, ``a`` to the counts and ``R^2 b`` to the squares."""
    radius = settings.row_clip_norm
    sums_weight, squares_weight = settings.selection_weights()
    per_row = math.sqrt(
        (radius * sums_weight) ** 2 + sums_weight**2 + (radius**2 * squares_weight) ** 2
    )
    rounding = settings.grid_granularity * math.sqrt(selection_dimension(n_features))
    return n_rows * per_row + rounding


def select_features(
    total: np.ndarray, n_features: int, total_rows: int, settings: PrivacySettings
) -> np.ndarray:
    """Coordinator: the k features with the largest standardised class-mean difference in the
    (noisy) round-1 sum, as sorted column indices. Post-processing: counts are clamped to at
    least 1, variances floored, ties broken by column order."""
    _check_two_rounds(settings)
    d = n_features
    if total.shape != (selection_dimension(d),):
        raise ShapeError(f"round-1 sum has shape {total.shape}, expected d = {d}")
    k = settings.selected_features
    if k > d:
        raise SparseLDAInputError(f"selected_features = {k} exceeds the {d} features")
    sums_weight, squares_weight = settings.selection_weights()
    sums_positive, sums_negative = total[:d] / sums_weight, total[d : 2 * d] / sums_weight
    count_positive = max(float(total[2 * d]) / sums_weight, 1.0)
    count_negative = max(float(total[2 * d + 1]) / sums_weight, 1.0)
    squares = total[2 * d + 2 :] / squares_weight
    mean_positive, mean_negative = sums_positive / count_positive, sums_negative / count_negative
    within = (
        squares - count_positive * mean_positive**2 - count_negative * mean_negative**2
    ) / total_rows
    score = np.abs(mean_positive - mean_negative) / np.sqrt(np.maximum(within, VARIANCE_FLOOR))
    order = np.lexsort((np.arange(d), -score))  # largest score first, then column order
    return np.sort(order[:k])


def selected_party(party: PartyData, selected: np.ndarray) -> PartyData:
    """The party's rows restricted to the selected columns (in their original order)."""
    columns = tuple(party.columns[j] for j in selected)
    return PartyData(party.name, party.features[:, selected], party.labels, columns)


def selected_statistics_vector(
    party: PartyData, settings: PrivacySettings, selected: np.ndarray
) -> np.ndarray:
    """Round 2, one party's exact vector: the moments vector of the k selected columns, rows
    clipped to ``selected_clip_norm`` in those k dimensions."""
    _check_two_rounds(settings)
    if len(selected) != settings.selected_features:
        raise ShapeError(f"{len(selected)} columns selected, expected {settings.selected_features}")
    return statistics_vector(selected_party(party, selected), settings.selected_round())


def model_from_selected(
    total: np.ndarray,
    selected: np.ndarray,
    n_features: int,
    total_rows: int,
    sum_noise_std: float,
    settings: PrivacySettings,
    fit: LocalFitSettings | None = None,
    *,
    noise_ridge_scale: float = NOISE_RIDGE_SCALE,
    sparse: bool = True,
) -> LinearDiscriminant:
    """Coordinator: the moments fit on the k selected features (noisy round-2 sum), embedded
    in all d features with zero weight and zero mean on the others (zero means do not move
    the score: its midpoint term only involves kept features). ``noise_ridge_scale`` and
    ``sparse`` as in :func:`model_from_statistics`."""
    _check_two_rounds(settings)
    small = model_from_statistics(
        total,
        len(selected),
        total_rows,
        sum_noise_std,
        settings.selected_round(),
        fit,
        noise_ridge_scale=noise_ridge_scale,
        sparse=sparse,
    )
    direction, positive, negative = (np.zeros(n_features) for _ in range(3))
    direction[selected] = small.direction
    positive[selected] = small.mean_positive
    negative[selected] = small.mean_negative
    return LinearDiscriminant(direction, positive, negative)
