"""The three ways to fit across parties, each ``parties -> LinearDiscriminant``.

* ``fit_debiased_aggregate``: the protocol. Local debiased fits, private average, threshold.
* ``fit_naive_average``: baseline. Same private average of the *un-debiased* local fits.
* ``fit_moments_release``: the row-level private protocol. Each party's clipped sufficient
  statistics plus noise shares are summed; one pooled sparse fit on the noisy sum.
* ``fit_selected_moments_release``: the same in two rounds, under one (epsilon, delta):
  noisy per-feature statistics select k features, then only their moments are released.
* ``fit_centralized``: reference only. The local estimator on all rows pooled, which the
  protocol exists to avoid; it shows what accuracy the pooled data could reach.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from core.sparse_lda.aggregation import (
    NO_THRESHOLD,
    SumVectors,
    ThresholdRule,
    model_from_average,
    plain_sum,
    sum_contributions,
)
from core.sparse_lda.errors import DegenerateDataError, SparseLDAInputError
from core.sparse_lda.local_fit import LocalEstimate, LocalFitSettings, fit_local
from core.sparse_lda.model import LinearDiscriminant
from core.sparse_lda.moments_release import (
    NOISE_RIDGE_SCALE,
    model_from_statistics,
    statistics_norm_bound,
    statistics_vector,
)
from core.sparse_lda.party_data import PartyData, check_same_columns
from core.sparse_lda.privacy import (
    BLOCKS_PER_CONTRIBUTION,
    PrivacySettings,
    PrivacyUnit,
    add_noise_share,
    average_noise_std,
    check_contribution,
    check_party_count,
    party_calibration,
    party_level_blocks,
)
from core.sparse_lda.selection_release import (
    model_from_selected,
    select_features,
    selected_statistics_vector,
    selection_norm_bound,
    selection_vector,
)

MapParties = Callable[
    [Callable[[PartyData], LocalEstimate], Sequence[PartyData]], Iterable[LocalEstimate]
]
"""``map``-like runner for local fits, e.g. ``ProcessPoolExecutor.map`` for parallel parties."""

DEFAULT_SETTINGS = LocalFitSettings()


def fit_debiased_aggregate(
    parties: Sequence[PartyData],
    privacy: PrivacySettings,
    settings: LocalFitSettings = DEFAULT_SETTINGS,
    rule: ThresholdRule | None = None,
    *,
    sum_vectors: SumVectors = plain_sum,
    map_parties: MapParties = map,
) -> LinearDiscriminant:
    """Average debiased local directions (and class means) privately, then hard-threshold."""
    return _fit_by_averaging(
        parties, privacy, settings, rule or ThresholdRule(), sum_vectors, map_parties, debiased=True
    )


def fit_naive_average(
    parties: Sequence[PartyData],
    privacy: PrivacySettings,
    settings: LocalFitSettings = DEFAULT_SETTINGS,
    *,
    sum_vectors: SumVectors = plain_sum,
    map_parties: MapParties = map,
) -> LinearDiscriminant:
    """Average the biased local L1 directions as they are: no debiasing, no threshold."""
    return _fit_by_averaging(
        parties, privacy, settings, NO_THRESHOLD, sum_vectors, map_parties, debiased=False
    )


def fit_centralized(
    parties: Sequence[PartyData], settings: LocalFitSettings = DEFAULT_SETTINGS
) -> LinearDiscriminant:
    """Reference only: one sparse LDA fit on every party's rows pooled together."""
    columns = check_same_columns(parties)
    pooled = PartyData(
        name="pooled",
        features=np.vstack([p.features for p in parties]),
        labels=np.concatenate([p.labels for p in parties]),
        columns=columns,
    )
    estimate = fit_local(pooled, settings, debiased=False)
    return LinearDiscriminant(
        estimate.sparse_direction, estimate.mean_positive, estimate.mean_negative
    )


def fit_moments_release(
    parties: Sequence[PartyData],
    privacy: PrivacySettings,
    settings: LocalFitSettings = DEFAULT_SETTINGS,
    *,
    sum_vectors: SumVectors = plain_sum,
) -> LinearDiscriminant:
    """Row-level DP: noisy clipped statistics of every party summed, one pooled sparse fit."""
    columns = check_same_columns(parties)
    n_parties = len(parties)
    calibration = party_calibration(privacy, len(columns), n_parties)
    contributions = []
    for party in parties:
        exact = statistics_vector(party, privacy)
        bound = statistics_norm_bound(party.n_rows, privacy, len(columns))
        check_contribution(party.name, exact, bound)
        noisy = exact if privacy.noise_disabled_for_testing else add_noise_share(exact, calibration)
        contributions.append(noisy)
    total = sum_contributions(contributions, sum_vectors)
    noise = 0.0 if privacy.noise_disabled_for_testing else calibration.sum_std(n_parties)
    rows = sum(p.n_rows for p in parties)
    return model_from_statistics(total, len(columns), rows, noise, privacy, settings)


def fit_selected_moments_release(
    parties: Sequence[PartyData],
    privacy: PrivacySettings,
    settings: LocalFitSettings = DEFAULT_SETTINGS,
    *,
    sum_vectors: SumVectors = plain_sum,
    noise_ridge_scale: float = NOISE_RIDGE_SCALE,
    sparse: bool = True,
) -> LinearDiscriminant:
    """Row-level DP in two secure sums (:mod:`core.sparse_lda.selection_release`): every party
    sends its noisy selection vector; the k selected columns (post-processing of that sum)
    go back to every party, which sends the noisy moments of those columns; one fit."""
    columns = check_same_columns(parties)
    d, n_parties = len(columns), len(parties)
    calibration = party_calibration(privacy, d, n_parties)
    noiseless = privacy.noise_disabled_for_testing

    def secure_round(vectors: list[np.ndarray]) -> np.ndarray:
        shares = vectors if noiseless else [add_noise_share(v, calibration) for v in vectors]
        return sum_contributions(shares, sum_vectors)

    first = []
    for party in parties:
        exact = selection_vector(party, privacy)
        check_contribution(party.name, exact, selection_norm_bound(party.n_rows, privacy, d))
        first.append(exact)
    rows = sum(p.n_rows for p in parties)
    selected = select_features(secure_round(first), d, rows, privacy)
    second_settings, k = privacy.selected_round(), len(selected)
    second = []
    for party in parties:
        exact = selected_statistics_vector(party, privacy, selected)
        check_contribution(
            party.name, exact, statistics_norm_bound(party.n_rows, second_settings, k)
        )
        second.append(exact)
    noise = 0.0 if noiseless else calibration.sum_std(n_parties)
    return model_from_selected(
        secure_round(second),
        selected,
        d,
        rows,
        noise,
        privacy,
        settings,
        noise_ridge_scale=noise_ridge_scale,
        sparse=sparse,
    )


def check_columns_usable(degenerate: dict[str, Sequence[str]], columns: Sequence[str]) -> None:
    """Refuse a column that every party reports degenerate: no site can estimate it."""
    if not degenerate:
        return
    everywhere = set(columns)
    for names in degenerate.values():
        everywhere &= set(names)
    if everywhere:
        column = next(c for c in columns if c in everywhere)
        raise DegenerateDataError(
            f"column {column!r} is constant within each class at every party "
            f"({', '.join(degenerate)}): no site can estimate it; drop the column"
        )


def party_contribution(
    estimate: LocalEstimate, privacy: PrivacySettings, n_parties: int, *, debiased: bool
) -> np.ndarray:
    """What one party feeds into the secure sum (runs at the party, so its noise stays there).

    The exact vector is checked first (finite; bounded: clipped, or within the noise-free
    coordinate bound), so a broken local fit is refused by name and never averaged in.
    """
    if privacy.unit is not PrivacyUnit.PARTY:
        raise SparseLDAInputError("local-fit contributions need party-level privacy settings")
    direction = estimate.debiased_direction if debiased else estimate.sparse_direction
    if direction is None:
        raise SparseLDAInputError(f"party {estimate.party!r}: local fit was run without debiasing")
    exact = party_level_blocks(direction, estimate.mean_positive, estimate.mean_negative, privacy)
    check_contribution(estimate.party, exact, None)
    if privacy.noise_disabled_for_testing:
        return exact
    return add_noise_share(exact, party_calibration(privacy, direction.shape[0], n_parties))


def model_from_sum(
    total: np.ndarray,
    n_parties: int,
    total_rows: int,
    privacy: PrivacySettings,
    rule: ThresholdRule,
) -> LinearDiscriminant:
    """Coordinator's last step: the (noisy) secure sum of contributions to a thresholded model."""
    noise_std = average_noise_std(privacy, total.shape[0] // BLOCKS_PER_CONTRIBUTION, n_parties)
    return model_from_average(total / n_parties, rule, total_rows, noise_std)


def _fit_by_averaging(
    parties: Sequence[PartyData],
    privacy: PrivacySettings,
    settings: LocalFitSettings,
    rule: ThresholdRule,
    sum_vectors: SumVectors,
    map_parties: MapParties,
    *,
    debiased: bool,
) -> LinearDiscriminant:
    check_same_columns(parties)
    n_parties = len(parties)
    if not privacy.noise_disabled_for_testing:
        check_party_count(privacy, n_parties)
    local = partial(fit_local, settings=settings, debiased=debiased)
    estimates = list(map_parties(local, parties))
    check_columns_usable({e.party: e.degenerate_columns for e in estimates}, parties[0].columns)
    contributions = [
        party_contribution(e, privacy, n_parties, debiased=debiased) for e in estimates
    ]
    total = sum_contributions(contributions, sum_vectors)
    return model_from_sum(total, n_parties, sum(p.n_rows for p in parties), privacy, rule)
