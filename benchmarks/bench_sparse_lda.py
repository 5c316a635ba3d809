"""Sparse LDA across parties: the synthetic experiment of Tian, Jayaraman, Gu & Evans (2016).

Setting: d = 200, Sigma_kl = 0.8^|k-l|, mu1 = 0, mu2 = (1 x 10, 0 x 190), 100 rows per class
per party, m parties, error measured on 10,000 fresh rows (5,000 per class). Prints markdown
tables, medians over repetitions on fresh data: centralized / naive averaging / debiased
aggregation / the two private modes beside the paper; error against epsilon for m = 20, 60,
100 in both privacy units (row: noisy clipped moments; party: noisy clipped debiased
directions); the pathological multi-site data (real and synthetic); the demo's hospitals at
the demo job's epsilon; and the precision-estimator comparison when asked for.

Private columns add one discrete Gaussian draw with the sum's sigma to the exact sum of the
parties' vectors: the same distribution as m shares (up to the negligible gap of summed
discrete Gaussians) at a fraction of the sampling time.

    python benchmarks/bench_sparse_lda.py [--quick] [--repetitions R] [--workers W]
        [--parties M ...] [--timing] [--clime]
"""

from __future__ import annotations

import argparse
import math
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from core.dp import gaussian_on_grid
from core.sparse_lda import (
    NO_THRESHOLD,
    LinearDiscriminant,
    LocalEstimate,
    LocalFitSettings,
    PartyData,
    PrecisionMethod,
    PrivacySettings,
    ThresholdRule,
    fit_centralized,
    fit_debiased_aggregate,
    fit_local,
    model_from_statistics,
    model_from_sum,
    party_calibration,
    party_contribution,
    plain_sum,
    statistics_vector,
    sum_contributions,
)
from core.sparse_lda.privacy import party_level_blocks

ROOT = Path(__file__).resolve().parents[1]
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
ROW_CLIP_NORM = 14.0  # about sqrt(d): clips the largest ~15% of rows a little
DEMO_JOB = ROOT / "jobs" / "sparse_lda_demo.json"
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
    """Party-level settings of the paper's experiment."""
    return PrivacySettings(epsilon, DELTA, DIRECTION_CLIP_NORM, MEAN_CLIP_NORM)


def row_privacy_at(epsilon: float, radius: float = ROW_CLIP_NORM, delta: float = DELTA):
    return PrivacySettings.row_level(epsilon, delta, radius)


def noisy(total: np.ndarray, privacy: PrivacySettings, d: int, m: int) -> tuple[np.ndarray, float]:
    """The exact sum plus one draw with the released sum's sigma (all m shares)."""
    std = party_calibration(privacy, d, m).sum_std(m)
    return total + gaussian_on_grid(std, privacy.grid_granularity, total.size), std


def party_private(
    estimates: Sequence[LocalEstimate], privacy: PrivacySettings, rule: ThresholdRule
) -> LinearDiscriminant:
    """Party unit: clipped debiased directions and means, summed, noise, threshold."""
    m, d = len(estimates), estimates[0].mean_positive.shape[0]
    blocks = [
        party_level_blocks(e.debiased_direction, e.mean_positive, e.mean_negative, privacy)
        for e in estimates
    ]
    total, _ = noisy(np.sum(blocks, axis=0), privacy, d, m)
    return model_from_sum(total, m, sum(e.n_rows for e in estimates), privacy, rule)


def row_private(
    exact_total: np.ndarray, d: int, m: int, rows: int, privacy: PrivacySettings
) -> LinearDiscriminant:
    """Row unit: the summed clipped statistics, noise, one pooled sparse fit."""
    total, std = noisy(exact_total, privacy, d, m)
    return model_from_statistics(total, d, rows, std, privacy)


def noiseless(estimates: Sequence[LocalEstimate], *, debiased: bool) -> LinearDiscriminant:
    """Naive (no threshold) or debiased (threshold) average without any noise."""
    privacy = PrivacySettings.noiseless_for_testing()
    m = len(estimates)
    contributions = [party_contribution(e, privacy, m, debiased=debiased) for e in estimates]
    total = sum_contributions(contributions, plain_sum)
    rule = ThresholdRule() if debiased else NO_THRESHOLD
    return model_from_sum(total, m, sum(e.n_rows for e in estimates), privacy, rule)


def local_fits(
    parties: Sequence[PartyData], settings: LocalFitSettings, pool: ProcessPoolExecutor
) -> list[LocalEstimate]:
    return list(pool.map(partial(fit_local, settings=settings, debiased=True), parties))


def med(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f}"


def synthetic_runs(
    model: SyntheticModel, ms: Sequence[int], reps: int, pool: ProcessPoolExecutor
) -> dict[int, dict[str, list[float]]]:
    """Every synthetic figure of one repetition on one fresh data set (per m)."""
    row_template = row_privacy_at(MAIN_EPSILON)
    results: dict[int, dict[str, list[float]]] = {}
    for m in ms:
        rng = np.random.default_rng(1000 + m)
        errors: dict[str, list[float]] = {}
        for _ in range(reps):
            parties = model.parties(m, rng)
            test_x, test_y = model.rows(TEST_ROWS_PER_CLASS, rng)
            start = time.perf_counter()
            estimates = local_fits(parties, LocalFitSettings(), pool)
            errors.setdefault("seconds", []).append(time.perf_counter() - start)
            rows = sum(p.n_rows for p in parties)
            stats = np.sum([statistics_vector(p, row_template) for p in parties], axis=0)
            fitted = {
                "centralized": fit_centralized(parties),
                "naive": noiseless(estimates, debiased=False),
                "debiased": noiseless(estimates, debiased=True),
            }
            for epsilon in EPSILONS:
                fitted[f"party {epsilon:g}"] = party_private(
                    estimates, privacy_at(epsilon), ThresholdRule()
                )
                fitted[f"row {epsilon:g}"] = row_private(
                    stats, N_FEATURES, m, rows, row_privacy_at(epsilon)
                )
            for key, lda in fitted.items():
                errors.setdefault(key, []).append(lda.error_rate(test_x, test_y))
                errors.setdefault(f"support {key}", []).append(lda.support_size)
        results[m] = errors
    return results


def main_table(results: dict[int, dict[str, list[float]]], reps: int) -> None:
    eps = f"{MAIN_EPSILON:g}"
    print(f"\n## Misclassification on 10,000 fresh rows, median of {reps} fresh data sets\n")
    print(
        f"Private columns: epsilon = {eps}, delta = {DELTA:g}. Row unit: rows clipped to "
        f"||x|| <= {ROW_CLIP_NORM:g}, noisy moments summed, one pooled sparse fit. Party unit: "
        f"||beta_tilde|| <= {DIRECTION_CLIP_NORM:g}, ||mu_k|| <= {MEAN_CLIP_NORM:g}. "
        f"Bayes error {BAYES_ERROR}.\n"
    )
    print(
        "| m | centralized | naive averaging | debiased | row-level DP | party-level DP "
        "| paper: centralized / naive / debiased | local fits s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m, errors in results.items():
        keys = ("centralized", "naive", "debiased", f"row {eps}", f"party {eps}")
        cells = " | ".join(med(errors[key]) for key in keys)
        paper = " / ".join(f"{v:.3f}" for v in PAPER[m])
        print(f"| {m} | {cells} | {paper} | {statistics.median(errors['seconds']):.1f} |")


def epsilon_table(results: dict[int, dict[str, list[float]]], reps: int) -> None:
    print(f"\n## Error against epsilon, delta = {DELTA:g}, median of {reps} (support size)\n")
    ms = list(results)
    print("| epsilon | " + " | ".join(f"m={m} row | m={m} party" for m in ms) + " |")
    print("|---|" + "---|---|" * len(ms))
    for epsilon in EPSILONS:
        cells = []
        for m in ms:
            for unit in ("row", "party"):
                key = f"{unit} {epsilon:g}"
                support = statistics.median(results[m][f"support {key}"])
                cells.append(f"{med(results[m][key])} ({support:g})")
        print(f"| {epsilon:g} | " + " | ".join(cells) + " |")


def pathological_table(reps: int, pool: ProcessPoolExecutor) -> None:
    from sparse_lda_sites import breast_sites, synthetic_sites

    print(f"\n## Awkward sites, held-out misclassification, median of {reps} splits\n")
    print(
        "Four sites; a test never run at two of them (column = pooled median), one measured for "
        "5% of a site's patients, one site with a 5% class; 20% of each site held out. "
        f"Private columns: epsilon = {MAIN_EPSILON:g}, delta = {DELTA:g}; row clip "
        "sqrt(d) + 0.5.\n"
    )
    print(
        "| data | centralized | naive | debiased, no noise | row-level DP | party-level DP "
        "| max abs(beta_tilde) over sites |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, build in (
        ("breast, 4 sites (real)", breast_sites),
        ("synthetic d=24", synthetic_sites),
    ):
        errors: dict[str, list[float]] = {}
        largest = []
        for seed in range(reps):
            sites = build(seed)
            parties, tx, ty = sites.parties, sites.test_features, sites.test_labels
            d, m = parties[0].n_features, len(parties)
            estimates = local_fits(parties, LocalFitSettings(), pool)
            largest.append(max(float(np.abs(e.debiased_direction).max()) for e in estimates))
            row = row_privacy_at(MAIN_EPSILON, math.sqrt(d) + 0.5)
            stats = np.sum([statistics_vector(p, row) for p in parties], axis=0)
            fitted = {
                "centralized": fit_centralized(parties),
                "naive": noiseless(estimates, debiased=False),
                "debiased": noiseless(estimates, debiased=True),
                "row": row_private(stats, d, m, sum(p.n_rows for p in parties), row),
                "party": party_private(estimates, privacy_at(MAIN_EPSILON), ThresholdRule()),
            }
            for key, lda in fitted.items():
                errors.setdefault(key, []).append(lda.error_rate(tx, ty))
        cells = " | ".join(
            med(errors[k]) for k in ("centralized", "naive", "debiased", "row", "party")
        )
        print(f"| {label} | {cells} | {statistics.median(largest):.3g} |")


def demo_table(reps: int) -> None:
    """The demo job's hospitals and options, 20% of each hospital held out."""
    import json

    import pandas as pd

    from core.sparse_lda import fit_debiased_aggregate, fit_moments_release, fit_naive_average

    job = json.loads(DEMO_JOB.read_text())
    options = job["sparse_lda"]
    frames = []
    for party in job["parties"].values():
        table = party["table"]
        frame = pd.read_csv(ROOT / party["source"])
        frames.append((table["party"], frame, table["id_column"], table["label_column"]))
    columns = tuple(c for c in frames[0][1].columns if c not in (frames[0][2], frames[0][3]))
    privacy = row_privacy_at(options["epsilon"], options["row_clip_norm"], options["delta"])
    errors: dict[str, list[float]] = {}
    for seed in range(reps):
        rng = np.random.default_rng(seed)
        parties, tx, ty = [], [], []
        for name, frame, _, label in frames:
            x, y = frame[list(columns)].to_numpy(float), frame[label].to_numpy()
            test = rng.random(len(y)) < 0.2
            parties.append(PartyData(name, x[~test], y[~test], columns))
            tx.append(x[test])
            ty.append(y[test])
        test_x, test_y = np.vstack(tx), np.concatenate(ty)
        quiet = PrivacySettings.noiseless_for_testing()
        private = fit_moments_release(parties, privacy)
        fitted = {
            "centralized": fit_centralized(parties),
            "naive": fit_naive_average(parties, quiet),
            "debiased": fit_debiased_aggregate(parties, quiet),
            "private": private,
        }
        for key, lda in fitted.items():
            errors.setdefault(key, []).append(lda.error_rate(test_x, test_y))
        errors.setdefault("kept", []).append(private.support_size)
    print(f"\n## Demo hospitals (jobs/sparse_lda_demo.json), held-out rows, median of {reps}\n")
    print(
        f"Private model as the demo runs it: row-level, epsilon = {options['epsilon']:g}, "
        f"delta = {options['delta']:g}, row clip {options['row_clip_norm']:g}; 30 features.\n"
    )
    print(
        "| centralized | naive average | debiased, no noise | private (row-level) | features kept |"
    )
    print("|---|---|---|---|---|")
    cells = " | ".join(med(errors[k]) for k in ("centralized", "naive", "debiased", "private"))
    print(f"| {cells} | {statistics.median(errors['kept']):g} of {len(columns)} |")


def protocol_timing(model: SyntheticModel, pool: ProcessPoolExecutor) -> None:
    m = 20
    parties = model.parties(m, np.random.default_rng(3))
    start = time.perf_counter()
    fit_debiased_aggregate(parties, privacy_at(MAIN_EPSILON), map_parties=pool.map)
    elapsed = time.perf_counter() - start
    print(
        f"\nOne full party-level protocol fit at m = {m} (local fits in the pool): {elapsed:.1f} s"
    )


def precision_table(
    model: SyntheticModel, reps: int, pool: ProcessPoolExecutor, workers: int
) -> None:
    m = 20
    print(f"\n## Precision estimator for debiasing, m = {m}, no DP noise\n")
    print("| estimator | error (median) | core-seconds per party (wall x workers / m) |")
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
            errors.append(noiseless(estimates, debiased=True).error_rate(test_x, test_y))
        print(f"| {label} | {med(errors)} | {statistics.median(per_party):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m = 20 only, 2 repetitions")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clime", action="store_true", help="also compare CLIME (slow)")
    parser.add_argument("--timing", action="store_true", help="time one full protocol fit")
    parser.add_argument(
        "--parties", type=int, nargs="+", choices=tuple(PAPER), help="m values (default all)"
    )
    args = parser.parse_args()
    reps = 2 if args.quick else args.repetitions
    ms = (20,) if args.quick else tuple(args.parties or PAPER)
    model = SyntheticModel()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        if args.timing:
            protocol_timing(model, pool)
        results = synthetic_runs(model, ms, reps, pool)
        main_table(results, reps)
        epsilon_table(results, reps)
        pathological_table(reps, pool)
        demo_table(reps)
        if args.clime:
            precision_table(model, 1 if args.quick else 2, pool, args.workers)


if __name__ == "__main__":
    main()
