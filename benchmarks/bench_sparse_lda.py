"""Sparse LDA across parties: the synthetic experiment of Tian, Jayaraman, Gu & Evans (2016).

Setting: d = 200, Sigma_kl = 0.8^|k-l|, mu1 = 0, mu2 = (1 x 10, 0 x 190), 100 rows per class
per party, m parties, error measured on 10,000 fresh rows (5,000 per class). Prints markdown
tables: centralized / naive averaging / debiased aggregation beside the paper, then the
error of debiased aggregation versus epsilon at m = 20, then the precision-estimator
comparison (nodewise lasso vs CLIME) when asked for.

    python benchmarks/bench_sparse_lda.py [--quick] [--repetitions R] [--workers W] [--clime]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
from scipy.linalg import toeplitz

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.sparse_lda import (
    NO_THRESHOLD,
    LinearDiscriminant,
    LocalEstimate,
    LocalFitSettings,
    PartyData,
    PrecisionMethod,
    PrivacySettings,
    ThresholdRule,
    average_noise_std,
    fit_centralized,
    fit_debiased_aggregate,
    fit_local,
    model_from_sum,
    party_contribution,
    plain_sum,
    sum_contributions,
)

N_FEATURES = 200
CORRELATION = 0.8
SIGNAL_FEATURES = 10
ROWS_PER_CLASS = 100
TEST_ROWS_PER_CLASS = 5_000
BAYES_ERROR = 0.1656
PAPER = {  # m: (centralized, naive averaged, debiased aggregation)
    20: (0.168, 0.240, 0.182),
    60: (0.166, 0.240, 0.179),
    100: (0.165, 0.240, 0.179),
}
MAIN_EPSILON = 10.0
DELTA = 1e-5
EPSILONS = (1.0, 3.0, 10.0, 30.0, 100.0)
DIRECTION_CLIP_NORM = 5.0
MEAN_CLIP_NORM = 4.0
COLUMNS = tuple(f"x{k}" for k in range(N_FEATURES))


class SyntheticModel:
    """Two Gaussian classes sharing an AR(1)-type covariance."""

    def __init__(self) -> None:
        covariance = toeplitz(CORRELATION ** np.arange(N_FEATURES))
        self.cholesky = np.linalg.cholesky(covariance)
        self.mean_positive = np.zeros(N_FEATURES)  # mu1, label 1
        self.mean_negative = np.zeros(N_FEATURES)  # mu2, label 0
        self.mean_negative[:SIGNAL_FEATURES] = 1.0

    def rows(self, per_class: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        noise = rng.standard_normal((2 * per_class, N_FEATURES)) @ self.cholesky.T
        labels = np.repeat(np.array([1, 0], dtype=np.int8), per_class)
        means = np.where(labels[:, None] == 1, self.mean_positive, self.mean_negative)
        return means + noise, labels

    def parties(self, m: int, rng: np.random.Generator) -> list[PartyData]:
        out = []
        for index in range(m):
            features, labels = self.rows(ROWS_PER_CLASS, rng)
            out.append(PartyData(f"party-{index}", features, labels, COLUMNS))
        return out


def privacy_at(epsilon: float) -> PrivacySettings:
    return PrivacySettings(epsilon, DELTA, DIRECTION_CLIP_NORM, MEAN_CLIP_NORM)


def aggregate(
    estimates: Sequence[LocalEstimate],
    privacy: PrivacySettings,
    *,
    debiased: bool,
    rule: ThresholdRule,
) -> LinearDiscriminant:
    """The coordinator's side of the protocol on already-fitted local estimates."""
    m = len(estimates)
    contributions = [party_contribution(e, privacy, m, debiased=debiased) for e in estimates]
    total = sum_contributions(contributions, plain_sum)
    return model_from_sum(total, m, sum(e.n_rows for e in estimates), privacy, rule)


def local_fits(
    parties: Sequence[PartyData], settings: LocalFitSettings, pool: ProcessPoolExecutor
) -> list[LocalEstimate]:
    return list(pool.map(partial(fit_local, settings=settings, debiased=True), parties))


def mean_sd(values: Sequence[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def main_table(
    model: SyntheticModel, ms: Sequence[int], reps: int, pool: ProcessPoolExecutor
) -> None:
    settings = LocalFitSettings()
    noiseless = PrivacySettings.noiseless_for_testing()
    private = privacy_at(MAIN_EPSILON)
    rule = ThresholdRule()
    print(f"\n## Misclassification on 10,000 fresh rows, mean ± sd over {reps} repetitions\n")
    print(
        f"Last DP column: epsilon = {MAIN_EPSILON:g}, delta = {DELTA:g} for the whole release "
        f"(party-level), clip ||beta_tilde|| <= {DIRECTION_CLIP_NORM:g}, "
        f"||mu_k|| <= {MEAN_CLIP_NORM:g}. Other columns add no noise. "
        f"Bayes error {BAYES_ERROR}.\n"
    )
    print(
        "| m | centralized | naive averaging | debiased | debiased, DP "
        "| paper: centralized / naive / debiased | local fits s |"
    )
    print("|---|---|---|---|---|---|---|")
    keys = ("centralized", "naive", "debiased", "debiased_dp")
    for m in ms:
        rng = np.random.default_rng(1000 + m)
        errors: dict[str, list[float]] = {key: [] for key in keys}
        seconds = []
        for _ in range(reps):
            parties = model.parties(m, rng)
            test_x, test_y = model.rows(TEST_ROWS_PER_CLASS, rng)
            start = time.perf_counter()
            estimates = local_fits(parties, settings, pool)
            seconds.append(time.perf_counter() - start)
            fitted = {
                "centralized": fit_centralized(parties, settings),
                "naive": aggregate(estimates, noiseless, debiased=False, rule=NO_THRESHOLD),
                "debiased": aggregate(estimates, noiseless, debiased=True, rule=rule),
                "debiased_dp": aggregate(estimates, private, debiased=True, rule=rule),
            }
            for key, lda in fitted.items():
                errors[key].append(lda.error_rate(test_x, test_y))
        paper = " / ".join(f"{v:.3f}" for v in PAPER[m])
        cells = " | ".join(mean_sd(errors[key]) for key in keys)
        print(f"| {m} | {cells} | {paper} | {statistics.median(seconds):.1f} |")


def epsilon_table(model: SyntheticModel, reps: int, pool: ProcessPoolExecutor) -> None:
    m = 20
    print(f"\n## Debiased aggregation versus epsilon, m = {m}, delta = {DELTA:g}\n")
    print(
        "Noise after aggregation: shares summing to one calibrated Gaussian. Noise before "
        f"aggregation: every party adds the full calibrated noise itself (shares sized for "
        f"{m - 1} colluders), i.e. each local model is private on its own.\n"
    )
    print(
        "| epsilon | noise sd per coordinate, after | error, noise after aggregation "
        "| support | error, noise before aggregation |"
    )
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(7)
    runs = []
    for _ in range(reps):
        parties = model.parties(m, rng)
        runs.append((local_fits(parties, LocalFitSettings(), pool), model.rows(5_000, rng)))
    for epsilon in EPSILONS:
        after = privacy_at(epsilon)
        before = replace(after, colluding_parties=m - 1)
        errors_after, errors_before, supports = [], [], []
        for estimates, (test_x, test_y) in runs:
            lda = aggregate(estimates, after, debiased=True, rule=ThresholdRule())
            errors_after.append(lda.error_rate(test_x, test_y))
            supports.append(lda.support_size)
            lda = aggregate(estimates, before, debiased=True, rule=ThresholdRule())
            errors_before.append(lda.error_rate(test_x, test_y))
        noise = average_noise_std(after, N_FEATURES, m)
        print(
            f"| {epsilon:g} | {noise:.3f} | {mean_sd(errors_after)} | "
            f"{statistics.median(supports):g} | {mean_sd(errors_before)} |"
        )


def protocol_timing(model: SyntheticModel, pool: ProcessPoolExecutor) -> None:
    m = 20
    parties = model.parties(m, np.random.default_rng(3))
    start = time.perf_counter()
    fit_debiased_aggregate(parties, privacy_at(MAIN_EPSILON), map_parties=pool.map)
    elapsed = time.perf_counter() - start
    print(f"\nOne full private protocol fit at m = {m} (local fits in the pool): {elapsed:.1f} s")


def precision_table(
    model: SyntheticModel, reps: int, pool: ProcessPoolExecutor, workers: int
) -> None:
    m = 20
    print(f"\n## Precision estimator for debiasing, m = {m}, no DP noise\n")
    print("| estimator | error (mean ± sd) | core-seconds per party (wall x workers / m) |")
    print("|---|---|---|")
    rng = np.random.default_rng(11)
    data = [(model.parties(m, rng), model.rows(5_000, rng)) for _ in range(reps)]
    base = LocalFitSettings()
    for label, settings in (
        ("nodewise lasso (default)", base),
        ("CLIME", replace(base, precision_method=PrecisionMethod.CLIME)),
    ):
        errors, per_party = [], []
        for parties, (test_x, test_y) in data:
            start = time.perf_counter()
            estimates = local_fits(parties, settings, pool)
            per_party.append((time.perf_counter() - start) / m * workers)
            lda = aggregate(
                estimates,
                PrivacySettings.noiseless_for_testing(),
                debiased=True,
                rule=ThresholdRule(),
            )
            errors.append(lda.error_rate(test_x, test_y))
        print(f"| {label} | {mean_sd(errors)} | {statistics.median(per_party):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m = 20 only, 2 repetitions")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clime", action="store_true", help="also compare CLIME (slow)")
    args = parser.parse_args()
    reps = 2 if args.quick else args.repetitions
    ms = (20,) if args.quick else tuple(PAPER)
    model = SyntheticModel()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        protocol_timing(model, pool)
        main_table(model, ms, reps, pool)
        epsilon_table(model, reps, pool)
        if args.clime:
            precision_table(model, 1 if args.quick else 2, pool, args.workers)


if __name__ == "__main__":
    main()
