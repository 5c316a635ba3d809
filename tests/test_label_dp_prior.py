"""The private prior: noise scale, clipping and normalising, budget split, grid, release.

The exact discrete Laplace sampler draws from the OS CSPRNG and cannot be seeded, so the
noise checks use large samples and bounds of about five standard errors (false alarm rate
below one in a million) while a wrong scale or sensitivity misses them by far.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.label_dp import (
    InvalidEpsilonError,
    InvalidLabelError,
    InvalidPriorError,
    counts_to_prior,
    default_prior_epsilon,
    label_grid,
    noisy_counts,
    private_prior,
    release_labels,
    rr_on_bins,
    split_budget,
)

HISTOGRAM_SENSITIVITY = 2  # one changed label: one count -1, another +1


def _discrete_laplace_moments(scale: float) -> tuple[float, float]:
    """P(0) and the variance of P(x) proportional to exp(-|x| / scale) on the integers."""
    ratio = math.exp(-1.0 / scale)
    return (1 - ratio) / (1 + ratio), 2 * ratio / (1 - ratio) ** 2


@pytest.mark.parametrize("epsilon", [0.25, 1.0])
def test_histogram_noise_is_discrete_laplace_with_scale_two_over_epsilon(epsilon: float) -> None:
    draws = 60_000
    noise = noisy_counts(np.zeros(draws, dtype=np.int64), epsilon)
    assert noise.dtype == np.int64
    zero_mass, variance = _discrete_laplace_moments(HISTOGRAM_SENSITIVITY / epsilon)
    # Kurtosis about 6.1 at these scales: the sample variance has relative s.e. sqrt(5.1 / n).
    assert abs(noise.var() / variance - 1) < 5 * math.sqrt(5.2 / draws)
    assert abs(noise.mean()) < 5 * math.sqrt(variance / draws)
    assert abs(np.mean(noise == 0) - zero_mass) < 5 * math.sqrt(zero_mass / draws)
    _, wrong_variance = _discrete_laplace_moments(1.0 / epsilon)  # sensitivity 1 by mistake
    assert abs(noise.var() / wrong_variance - 1) > 0.5


def test_noise_is_added_to_the_counts() -> None:
    counts = np.array([0, 500_000, 7])
    noisy = noisy_counts(counts, 2.0)
    assert np.all(np.abs(noisy - counts) < 60)  # scale 1: P(|noise| >= 60) < 1e-25


def test_counts_to_prior_clips_normalises_and_handles_all_zero() -> None:
    np.testing.assert_allclose(counts_to_prior(np.array([-3, 1, 0, 3])), [0, 0.25, 0, 0.75])
    np.testing.assert_allclose(counts_to_prior(np.array([-2, -1, 0])), [1 / 3] * 3)


def test_private_prior_is_close_to_the_truth_for_many_labels() -> None:
    rng = np.random.default_rng(4)
    truth = rng.dirichlet(np.ones(21))
    counts = rng.multinomial(200_000, truth)
    estimate = private_prior(counts, 1.0)
    assert estimate.sum() == pytest.approx(1.0)
    assert np.all(estimate >= 0)
    # noise scale 2 per count: L1 error about 21 * 2 / 200k, plus sampling error.
    assert np.abs(estimate - truth).sum() < 0.01


def test_budget_split_follows_the_sqrt_k_over_n_rule_with_a_cap() -> None:
    eps1, eps2 = split_budget(2.0, grid_size=100, label_count=40_000)
    assert eps1 == pytest.approx(0.05) and eps1 + eps2 == pytest.approx(2.0)
    assert default_prior_epsilon(0.1, 100, 400) == pytest.approx(0.05)  # capped at eps / 2
    assert split_budget(1.0, 10, 100, prior_epsilon=0.3) == pytest.approx((0.3, 0.7))


def test_budget_errors() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidEpsilonError, match="epsilon"):
            split_budget(bad, 10, 100)
    with pytest.raises(InvalidEpsilonError, match="nothing would be left"):
        split_budget(1.0, 10, 100, prior_epsilon=1.0)
    with pytest.raises(InvalidEpsilonError, match="epsilon"):
        noisy_counts(np.array([1, 2]), 0.0)
    with pytest.raises(InvalidLabelError, match="one label"):
        default_prior_epsilon(1.0, 10, 0)


def test_default_grids() -> None:
    integers = label_grid(0, 9, integer=True)
    np.testing.assert_array_equal(integers.points, np.arange(10))
    wide = label_grid(0, 50_000, integer=True)
    assert wide.size == 1_000 and wide.low == 0 and wide.high == 50_000
    np.testing.assert_allclose(np.diff(wide.points), 50_000 / 999)
    assert label_grid(0.0, 1.0, max_size=11).size == 11
    with pytest.raises(InvalidPriorError, match="low <= high"):
        label_grid(3, 1)
    with pytest.raises(InvalidPriorError, match="max_size"):
        label_grid(0, 1, max_size=0)


def test_snapping_clipping_and_label_errors() -> None:
    grid = label_grid(0.0, 1.0, max_size=5)  # 0, .25, .5, .75, 1
    np.testing.assert_allclose(grid.snap([0.1, 0.13, 0.6, -4.0, 9.0]), [0, 0.25, 0.5, 0, 1])
    np.testing.assert_array_equal(grid.counts([0.0, 0.1, 1.0]), [2, 0, 0, 0, 1])
    with pytest.raises(InvalidLabelError, match=r"labels\[2\] = 1.5 is outside .*\(2 labels"):
        grid.positions([0.2, 0.4, 1.5, -1.0], clip=False)
    with pytest.raises(InvalidLabelError, match=r"labels\[1\] is NaN"):
        grid.snap([0.2, float("nan")])
    with pytest.raises(InvalidLabelError, match="empty"):
        grid.snap([])


def test_release_spends_the_budget_once_and_emits_only_bin_values() -> None:
    rng = np.random.default_rng(12)
    size, k = 200_000, 13
    labels = np.clip(rng.poisson(3.0, size=size), 0, k - 1)
    grid = label_grid(0, k - 1, integer=True)
    release = release_labels(labels, grid, 2.0, "poisson", rng=np.random.default_rng(1))
    assert release.epsilon == pytest.approx(2.0)
    assert release.prior_epsilon == pytest.approx(math.sqrt(k / size))
    assert np.all(np.isin(release.noisy_labels, release.mechanism.outputs))
    # Prior error: k noise draws with E|noise| = scale and sd about scale; allow 5 sd.
    truth = np.bincount(labels, minlength=k) / size
    scale = HISTOGRAM_SENSITIVITY / release.prior_epsilon
    assert np.abs(release.mechanism.prior - truth).sum() < (k + 5 * math.sqrt(k)) * scale / size
    # Built for the noisy prior with eps2, it cannot beat the eps2-optimum for the true prior
    # (it would if it spent more budget) and stays close to it.
    best = rr_on_bins(grid.points, truth, release.label_epsilon, "poisson").expected_loss()
    achieved = release.mechanism.expected_loss(truth)
    assert best * (1 - 1e-12) <= achieved < 1.02 * best
    with pytest.raises(InvalidLabelError, match="outside"):
        release_labels([1, 20], grid, 1.0, "squared", clip=False)
