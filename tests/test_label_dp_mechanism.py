"""RR-on-Bins optimality and exact DP, the baselines, sampling, and bad input."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import chisquare

from core.label_dp import (
    InvalidEpsilonError,
    InvalidLabelError,
    InvalidPriorError,
    LabelMechanism,
    UnknownLossError,
    clipped_laplace,
    exponential_mechanism,
    pointwise_loss,
    rr_on_bins,
    staircase_mechanism,
    train_on_noisy_labels,
)
from core.label_dp.channel import QuantisedChannel
from core.label_dp.randomness import bernoulli_at_most, integers_below

LOSSES = ("squared", "absolute", "poisson")
DP_SLACK = 1e-12  # float round-off only


# ----------------------------------------------------------------- independent references


def _best_bin_value(values: np.ndarray, weights: np.ndarray, loss: str) -> float:
    """Numerical minimiser of sum_t weights_t loss(v, y_t), with no closed form used."""
    if loss == "absolute":  # piecewise linear: a minimum sits on a label
        return float(min(values, key=lambda v: np.sum(weights * np.abs(v - values))))
    low = max(values[0], 1e-9) if loss == "poisson" else values[0]
    result = minimize_scalar(
        lambda v: float(np.sum(weights * pointwise_loss(loss, v, values))),
        bounds=(low, max(values[-1], low)),
        method="bounded",
        options={"xatol": 1e-12},
    )
    return float(result.x)


def _rr_loss(values, prior, epsilon, loss, bins, bin_values) -> float:
    """Expected loss of RR over ``bins`` (list of index arrays) straight from its matrix."""
    m = len(bins)
    big = math.exp(epsilon)
    matrix = np.full((len(values), m), 1.0 / (big + m - 1))
    for j, members in enumerate(bins):
        matrix[members, j] = big / (big + m - 1)
    losses = pointwise_loss(loss, np.asarray(bin_values)[None, :], values[:, None])
    return float(prior @ (matrix * losses).sum(axis=1))


def brute_force_rr_loss(values: np.ndarray, prior: np.ndarray, epsilon: float, loss: str) -> float:
    """Minimum over every split of the sorted values into runs, and every bin value."""
    k = len(values)
    big = math.exp(epsilon)
    best_value = {}
    for start in range(k):
        for end in range(start + 1, k + 1):
            inside = np.zeros(k, dtype=bool)
            inside[start:end] = True
            weights = prior * np.where(inside, big, 1.0)
            best_value[start, end] = _best_bin_value(values, weights, loss)
    best = math.inf
    for m in range(1, k + 1):
        for cuts in itertools.combinations(range(1, k), m - 1):
            edges = (0, *cuts, k)
            runs = list(itertools.pairwise(edges))
            bins = [np.arange(a, b) for a, b in runs]
            bin_values = [best_value[run] for run in runs]
            best = min(best, _rr_loss(values, prior, epsilon, loss, bins, bin_values))
    return best


def _random_case(rng: np.random.Generator, loss: str, with_zeros: bool):
    k = int(rng.integers(2, 9))
    values = np.sort(rng.choice(np.arange(0, 40), size=k, replace=False)).astype(float)
    if loss == "squared":
        values = values / 3.0 - 5.0  # negative and fractional labels too
    prior = rng.dirichlet(np.full(k, 0.8))
    if with_zeros:
        prior[rng.choice(k, size=k // 3, replace=False)] = 0.0
        prior[rng.integers(k)] += 0.1
    return values, prior / prior.sum()


# ----------------------------------------------------------------------------- RR-on-Bins


@pytest.mark.parametrize(
    ("epsilon", "expected"), [(1.0, 1.689835), (2.0, 1.119624), (4.0, 0.326746)]
)
def test_reference_values_uniform_prior_squared_loss(epsilon: float, expected: float) -> None:
    mechanism = rr_on_bins(np.arange(5), np.full(5, 0.2), epsilon, "squared")
    assert mechanism.expected_loss() == pytest.approx(expected, abs=5e-7)


@pytest.mark.parametrize("loss", LOSSES)
def test_expected_loss_equals_brute_force_over_all_monotone_partitions(loss: str) -> None:
    rng = np.random.default_rng(2023)
    for case in range(8):
        values, prior = _random_case(rng, loss, with_zeros=case >= 6)
        for epsilon in (0.1, 1.0, 3.0, 8.0):
            mechanism = rr_on_bins(values, prior, epsilon, loss)
            reference = brute_force_rr_loss(values, prior, epsilon, loss)
            assert mechanism.expected_loss() == pytest.approx(reference, rel=1e-8, abs=1e-12), (
                values,
                prior,
                epsilon,
            )


def _layered_dp_reference(values: np.ndarray, prior: np.ndarray, epsilon: float) -> float:
    """The paper's O(k^3) dynamic program over (last label, number of bins), squared loss."""
    k = len(values)
    c = math.expm1(epsilon)
    cost = np.full((k + 1, k + 1), np.inf)  # cost[a, b]: bin holding labels a .. b-1
    for a in range(k):
        ends = np.arange(a + 1, k + 1)
        inside = np.arange(k)[None, :] < ends[:, None]
        weights = prior[None, :] * (1.0 + c * (inside & (np.arange(k)[None, :] >= a)))
        centre = (weights @ values) / weights.sum(axis=1)
        cost[a, a + 1 :] = (weights * (values[None, :] - centre[:, None]) ** 2).sum(axis=1)
    table = np.full(k + 1, np.inf)
    table[0] = 0.0
    best = math.inf
    for bins in range(1, k + 1):
        table = np.min(table[:, None] + cost, axis=0)
        best = min(best, table[k] / (c + bins))
    return best


@pytest.mark.parametrize(("size", "epsilons"), [(60, (0.3, 2.0, 6.0)), (520, (2.0,))])
def test_large_instances_match_the_papers_layered_dynamic_program(size, epsilons) -> None:
    """520 labels also exercises the coarse warm start used above 512 labels."""
    rng = np.random.default_rng(size)
    values = np.sort(rng.choice(10 * size, size=size, replace=False)).astype(float)
    prior = rng.dirichlet(np.full(size, 0.5))
    for epsilon in epsilons:
        mechanism = rr_on_bins(values, prior, epsilon, "squared")
        reference = _layered_dp_reference(values, prior, epsilon)
        assert mechanism.expected_loss() == pytest.approx(reference, rel=1e-9)


@pytest.mark.parametrize("loss", LOSSES)
def test_rr_on_bins_shape_and_monotone_bins(loss: str) -> None:
    rng = np.random.default_rng(7)
    values = np.arange(30, dtype=float)
    prior = rng.dirichlet(np.ones(30))
    prior[[3, 17]] = 0.0
    mechanism = rr_on_bins(values, prior, 2.0, loss)
    assert isinstance(mechanism, LabelMechanism)
    assert np.all(np.diff(mechanism.outputs) > 0)
    assert np.all(np.diff(mechanism.bin_of) >= 0)  # bins are runs of sorted values
    assert set(mechanism.bin_of) == set(range(mechanism.bin_count))
    matrix = mechanism.transition_matrix()
    assert matrix.shape == (30, mechanism.bin_count)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12)


def _assert_exactly_dp(matrix: np.ndarray, epsilon: float) -> None:
    assert np.all(matrix >= 0)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-9)
    column_max, column_min = matrix.max(axis=0), matrix.min(axis=0)
    assert np.all(column_min > 0)
    assert np.all(column_max <= column_min * math.exp(epsilon) * (1 + DP_SLACK))


@pytest.mark.parametrize("loss", LOSSES)
def test_rr_on_bins_transition_matrix_is_exactly_epsilon_dp(loss: str) -> None:
    rng = np.random.default_rng(11)
    for epsilon in (0.05, 0.5, 1.0, 4.0, 8.0):
        values = np.sort(rng.choice(200, size=25, replace=False)).astype(float)
        mechanism = rr_on_bins(values, rng.dirichlet(np.ones(25)), epsilon, loss)
        matrix = mechanism.transition_matrix()
        _assert_exactly_dp(matrix, epsilon)
        if mechanism.bin_count > 1:  # the budget is used in full, not wasted
            ratio = matrix.max(axis=0) / matrix.min(axis=0)
            assert ratio.max() == pytest.approx(math.exp(epsilon), rel=1e-12)


def test_more_budget_never_hurts_and_huge_budget_reaches_zero_loss() -> None:
    values = np.arange(8, dtype=float)
    prior = np.random.default_rng(3).dirichlet(np.ones(8))
    losses = [rr_on_bins(values, prior, eps, "squared").expected_loss() for eps in (0.1, 1, 4, 8)]
    assert losses == sorted(losses, reverse=True)
    assert rr_on_bins(values, prior, 40.0, "squared").expected_loss() < 1e-12


# ------------------------------------------------------------------------------- baselines


BASELINES = [clipped_laplace, exponential_mechanism, staircase_mechanism]


@pytest.mark.parametrize("factory", BASELINES)
@pytest.mark.parametrize("loss", LOSSES)
def test_baselines_are_exactly_dp_and_never_beat_rr_on_bins(factory, loss: str) -> None:
    values = np.arange(0.0, 21.0)
    prior = np.exp(-(((values - 6.0) / 4.0) ** 2))
    prior /= prior.sum()
    for epsilon in (0.1, 1.0, 4.0):
        baseline = factory(values, epsilon, loss, prior)
        assert isinstance(baseline, LabelMechanism)
        _assert_exactly_dp(baseline.transition_matrix(), epsilon)
        optimal = rr_on_bins(values, prior, epsilon, loss)
        assert optimal.expected_loss() <= baseline.expected_loss() * (1 + 1e-12)


def test_clipped_laplace_matrix_matches_the_two_sided_geometric() -> None:
    epsilon, size = 2.0, 6
    matrix = clipped_laplace(np.arange(size), epsilon, "squared").transition_matrix()
    ratio = math.exp(-epsilon / (size - 1))
    offsets = np.arange(-400, 401)
    pmf = (1 - ratio) / (1 + ratio) * ratio ** np.abs(offsets)
    for source in range(size):
        landed = np.clip(source + offsets, 0, size - 1)
        expected = np.bincount(landed, weights=pmf, minlength=size)
        np.testing.assert_allclose(matrix[source], expected, rtol=1e-12)


def test_staircase_is_dp_for_every_step_width() -> None:
    from core.label_dp.staircase import staircase_matrix

    for size in (2, 3, 4, 7):
        for step in range(1, size):
            for epsilon in (0.2, 1.0, 5.0):
                _assert_exactly_dp(staircase_matrix(size, step, epsilon), epsilon)


def test_exponential_mechanism_beats_its_textbook_temperature_but_stays_dp() -> None:
    values = np.arange(0.0, 11.0)
    mechanism = exponential_mechanism(values, 1.0, "absolute")
    matrix = mechanism.transition_matrix()
    textbook = np.exp(-np.abs(values[None, :] - values[:, None]) * 1.0 / (2 * 10.0))
    textbook /= textbook.sum(axis=1, keepdims=True)
    assert np.trace(matrix) > np.trace(textbook)  # more mass on the true label
    _assert_exactly_dp(matrix, 1.0)


def test_laplace_and_staircase_need_an_evenly_spaced_grid() -> None:
    for factory in (clipped_laplace, staircase_mechanism):
        with pytest.raises(InvalidPriorError, match=r"evenly spaced.*values\[2\]"):
            factory([0.0, 1.0, 3.0], 1.0, "squared")


# -------------------------------------------------------------------------------- sampling


def _chi_square_per_row(mechanism, rng, draws_per_value: int = 4000) -> None:
    matrix = mechanism.transition_matrix()
    labels = np.repeat(mechanism.values, draws_per_value)
    noisy = mechanism.randomize(labels, rng)
    assert np.all(np.isin(noisy, mechanism.outputs))
    columns = np.searchsorted(mechanism.outputs, noisy)
    for row in range(len(mechanism.values)):
        observed = np.bincount(
            columns[row * draws_per_value : (row + 1) * draws_per_value],
            minlength=len(mechanism.outputs),
        )
        expected = matrix[row] * draws_per_value
        assert chisquare(observed, expected).pvalue > 1e-4, (row, observed, expected)


def test_rr_on_bins_randomize_follows_the_transition_matrix() -> None:
    values = np.arange(12, dtype=float)
    prior = np.random.default_rng(5).dirichlet(np.ones(12))
    mechanism = rr_on_bins(values, prior, 4.0, "squared")
    assert mechanism.bin_count >= 3
    _chi_square_per_row(mechanism, np.random.default_rng(99))


@pytest.mark.parametrize("factory", [exponential_mechanism, staircase_mechanism])
def test_channel_sampling_follows_the_transition_matrix(factory) -> None:
    mechanism = factory(np.arange(6.0), 1.5, "squared")
    _chi_square_per_row(mechanism, np.random.default_rng(100))


def test_default_csprng_randomize_keeps_true_bin_at_the_stated_rate() -> None:
    mechanism = rr_on_bins(np.arange(5), np.full(5, 0.2), 1.0, "squared")
    labels = np.full(40_000, 3.0)
    noisy = mechanism.randomize(labels)  # no rng: secrets-based CSPRNG
    kept = np.mean(noisy == mechanism.outputs[mechanism.bin_of[3]])
    p = mechanism.keep_probability
    assert abs(kept - p) < 5 * math.sqrt(p * (1 - p) / len(labels))
    laplace_noisy = clipped_laplace(np.arange(5), 1.0, "squared").randomize(labels)
    assert set(np.unique(laplace_noisy)) <= set(range(5))


def test_exact_draw_primitives() -> None:
    rng = np.random.default_rng(0)
    draws = integers_below(7, 70_000, rng)
    assert chisquare(np.bincount(draws, minlength=7)).pvalue > 1e-4
    assert draws.min() >= 0 and draws.max() <= 6
    assert bernoulli_at_most(1.0, 10, rng).all() and not bernoulli_at_most(0.0, 10, rng).any()
    hits = bernoulli_at_most(0.3, 100_000, rng).mean()
    assert abs(hits - 0.3) < 5 * math.sqrt(0.21 / 100_000)


def test_quantised_channel_refuses_a_matrix_that_is_not_dp() -> None:
    with pytest.raises(InvalidEpsilonError, match="privacy loss"):
        QuantisedChannel.from_matrix(np.array([[0.9, 0.1], [0.1, 0.9]]), 1.0)


# ------------------------------------------------------------------------------- training


def test_train_on_noisy_labels_recovers_a_linear_signal() -> None:
    rng = np.random.default_rng(8)
    features = rng.normal(size=(3000, 3))
    clean = features @ np.array([2.0, -1.0, 0.5]) + 10.0
    model = train_on_noisy_labels(features, clean + rng.normal(size=3000), "squared")
    assert np.mean((model.predict(features) - clean) ** 2) < 0.01
    counts = rng.poisson(np.exp(0.3 * features[:, 0]))
    poisson = train_on_noisy_labels(features, counts, "poisson")
    assert poisson[-1].coef_[0] == pytest.approx(0.3, abs=0.06)
    median = train_on_noisy_labels(features[:500], clean[:500], "absolute")
    assert np.max(np.abs(median.predict(features[:500]) - clean[:500])) < 1e-6


# ------------------------------------------------------------------------------- bad input


def test_bad_input_errors_name_the_problem() -> None:
    with pytest.raises(InvalidEpsilonError, match="epsilon"):
        rr_on_bins([0, 1], [0.5, 0.5], 0.0, "squared")
    with pytest.raises(InvalidEpsilonError, match="epsilon"):
        rr_on_bins([0, 1], [0.5, 0.5], float("nan"), "squared")
    with pytest.raises(UnknownLossError, match="huber"):
        rr_on_bins([0, 1], [0.5, 0.5], 1.0, "huber")
    with pytest.raises(InvalidPriorError, match=r"strictly increasing; values\[2\]"):
        rr_on_bins([0, 2, 1], [1, 1, 1], 1.0, "squared")
    with pytest.raises(InvalidPriorError, match=r"probs\[1\] is -0.1"):
        rr_on_bins([0, 1], [0.5, -0.1], 1.0, "squared")
    with pytest.raises(InvalidPriorError, match="sums to 0"):
        rr_on_bins([0, 1], [0, 0], 1.0, "squared")
    with pytest.raises(InvalidPriorError, match="shape"):
        rr_on_bins([0, 1, 2], [0.5, 0.5], 1.0, "squared")
    with pytest.raises(InvalidPriorError, match="poisson"):
        rr_on_bins([-1, 1], [0.5, 0.5], 1.0, "poisson")
    mechanism = rr_on_bins([0, 1, 2], [1, 1, 1], 1.0, "squared")
    with pytest.raises(InvalidLabelError, match=r"labels\[2\] = 1.5 is not one"):
        mechanism.randomize([0, 1, 1.5, 7])
    with pytest.raises(InvalidLabelError, match=r"labels\[1\] is NaN"):
        mechanism.randomize([0, np.nan])
    with pytest.raises(InvalidLabelError, match="empty"):
        mechanism.randomize([])
    with pytest.raises(TypeError, match="Generator"):
        mechanism.randomize([0, 1], rng=42)
    with pytest.raises(TypeError, match="rng=None"):
        clipped_laplace([0, 1, 2], 1.0, "squared").randomize([0], np.random.default_rng(0))
    with pytest.raises(InvalidLabelError, match=r"row 1"):
        train_on_noisy_labels(np.ones((3, 2)), [1.0, np.nan, 2.0], "squared")
    with pytest.raises(InvalidLabelError, match="shape"):
        train_on_noisy_labels(np.ones((3, 2)), [1.0, 2.0], "squared")
