"""WALR utility versus epsilon on FATE's default_credit, next to noisy labels.

Usage: python benchmarks/bench_walr.py [--quick] [--repetitions R] [--l2 L]

Data: the guest (label + 13 features) and host (10 features) files joined on ``id``: 30,000 rows,
23 standardised features. A fixed 80/20 split (seed 0) gives 24,000 training and 6,000 held-out
rows; AUC is measured on the held-out rows. Only the noise changes between repetitions; the
table shows the median over repetitions.

Methods, all at (epsilon, delta) label-DP with delta = 1 / N_train^1.1 (randomized response is
pure epsilon-DP):

* WALR clipped: rows clipped to L2 norm C = 90th percentile of training row norms (a feature-
  only choice, so it spends no label privacy), intercept included, sensitivity sqrt(C^2 + 1);
  sigma from the discrete Gaussian's zCDP bound.
* WALR binary: features binarised as x > 0, sensitivity sqrt(23 + 1); sigma from the exact
  discrete-Gaussian delta for 0/1 shifts.
* Noisy labels: each training label flipped with probability 1 / (1 + e^epsilon) (randomized
  response), then ordinary logistic regression on the raw features.

The label-weighted sum is computed in plaintext here; the encrypted path is tested to give the
same exact sum. All models use the same ridge penalty l2 (scikit-learn C = 1 / (N l2)).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from threadpoolctl import threadpool_limits

from core.walr import (
    WalrFeatures,
    fit_walr,
    label_weighted_sum,
    prepare_binary_features,
    prepare_clipped_features,
    release_noise,
    walr_sigma,
)

DATA = Path(__file__).resolve().parent / "data" / "fate"
EPSILONS = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
CLIP_QUANTILE = 0.9
SPLIT_SEED = 0


@dataclass(frozen=True)
class Split:
    train_features: np.ndarray
    train_labels: np.ndarray
    test_features: np.ndarray
    test_labels: np.ndarray


def load_default_credit() -> Split:
    """Join guest and host on id and split 80/20 with a fixed seed."""
    guest = pd.read_csv(DATA / "default_credit_hetero_guest.csv.gz")
    host = pd.read_csv(DATA / "default_credit_hetero_host.csv.gz")
    joined = guest.merge(host, on="id", suffixes=("_guest", "_host"), validate="one_to_one")
    labels = joined["y"].to_numpy(dtype=np.int64)
    features = joined.drop(columns=["id", "y"]).to_numpy(dtype=np.float64)
    order = np.random.default_rng(SPLIT_SEED).permutation(labels.size)
    test, train = order[: labels.size // 5], order[labels.size // 5 :]
    return Split(features[train], labels[train], features[test], labels[test])


def secure_uniform(count: int) -> np.ndarray:
    """Uniform [0, 1) floats with 53 random bits from the OS CSPRNG."""
    words = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    return (words >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def walr_auc(
    train: WalrFeatures, split: Split, test: np.ndarray, sigma: float | None, l2: float
) -> float:
    """Release the label-weighted sum (noiseless when sigma is None), fit, score held-out."""
    exact = label_weighted_sum(train, split.train_labels)
    if sigma is None:
        noisy = release_noise(exact, 1.0, train.granularity, noise=False, testing=True)
    else:
        noisy = release_noise(exact, sigma, train.granularity)
    fit = fit_walr(train.values, noisy, train.n_rows, l2)
    if not fit.converged:
        print(f"warning: WALR fit did not converge (sigma={sigma})", file=sys.stderr)
    return float(roc_auc_score(split.test_labels, fit.decision_function(test)))


def noisy_label_auc(split: Split, epsilon: float, l2: float) -> float:
    """Randomized response on the training labels, then ordinary logistic regression."""
    labels = split.train_labels
    if math.isfinite(epsilon):
        flip = secure_uniform(labels.size) < 1.0 / (1.0 + math.exp(epsilon))
        labels = np.where(flip, 1 - labels, labels)
    model = LogisticRegression(C=1.0 / (labels.size * l2), max_iter=5_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(split.train_features, labels)
    return float(roc_auc_score(split.test_labels, model.decision_function(split.test_features)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions instead of 5")
    parser.add_argument("--repetitions", type=int, default=None)
    parser.add_argument("--l2", type=float, default=1e-3, help="ridge penalty (default 1e-3)")
    args = parser.parse_args()
    repetitions = args.repetitions or (2 if args.quick else 5)

    started = time.perf_counter()
    split = load_default_credit()
    rows = split.train_labels.size
    delta = 1.0 / rows**1.1
    clip = float(np.quantile(np.linalg.norm(split.train_features, axis=1), CLIP_QUANTILE))
    clipped = prepare_clipped_features(split.train_features, clip)
    clipped_test = prepare_clipped_features(split.test_features, clip).values
    binary = prepare_binary_features(split.train_features > 0)
    binary_test = (split.test_features > 0).astype(np.float64)

    print(
        f"WALR on default_credit: {rows} training rows, {split.test_labels.size} held-out, "
        f"{split.train_features.shape[1]} features"
    )
    print(
        f"delta = 1/N^1.1 = {delta:.3g}; clip C = {clip:.3f} (q{CLIP_QUANTILE:g} of row "
        f"norms), grid 2^{int(math.log2(clipped.granularity))}; l2 = {args.l2:g}; "
        f"median of {repetitions} repetitions; held-out AUC"
    )
    print()
    print(
        "| epsilon | sigma clipped | WALR clipped | sigma binary | WALR binary "
        "| noisy labels (RR) |"
    )
    print("|---|---|---|---|---|---|")
    for epsilon in EPSILONS:
        if math.isfinite(epsilon):
            sigma_clipped = walr_sigma(epsilon, delta, clipped)
            sigma_binary = walr_sigma(epsilon, delta, binary)
        else:
            sigma_clipped = sigma_binary = None
        runs = repetitions if math.isfinite(epsilon) else 1
        walr = [walr_auc(clipped, split, clipped_test, sigma_clipped, args.l2) for _ in range(runs)]
        walr_bin = [
            walr_auc(binary, split, binary_test, sigma_binary, args.l2) for _ in range(runs)
        ]
        noisy = [noisy_label_auc(split, epsilon, args.l2) for _ in range(runs)]
        print(
            f"| {epsilon:g} | {_fmt(sigma_clipped)} | {statistics.median(walr):.4f} "
            f"| {_fmt(sigma_binary)} | {statistics.median(walr_bin):.4f} "
            f"| {statistics.median(noisy):.4f} |"
        )
    print()
    print(f"total time {time.perf_counter() - started:.1f} s (single-threaded BLAS)")


def _fmt(sigma: float | None) -> str:
    return "0 (no noise)" if sigma is None else f"{sigma:.2f}"


if __name__ == "__main__":
    with threadpool_limits(limits=1):
        main()
