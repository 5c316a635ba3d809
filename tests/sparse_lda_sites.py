"""Multi-site sparse LDA data with the pathologies real sites have (tests and benchmark).

A bundled real data set (the FATE copy of UCI breast cancer, 569 rows, 30 standardised
features, several nearly collinear) split into four sites, then made awkward the way
clinical sites are: a test one site never ran (the column holds the pooled median for every
patient), a test another site ran for a few patients only (median elsewhere: near-constant),
and a site where one class is about 5% of its patients. Each site keeps 20% of its rows for
testing. ``synthetic_sites`` builds the same pathologies on small Gaussian data, and
``stressed_sites`` harsher ones at random (sites of a dozen rows, classes of two rows).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from core.sparse_lda import PartyData

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "fate"
BREAST_FILES = ("breast_homo_guest", "breast_homo_host", "breast_homo_test")
SITES = ("site_a", "site_b", "site_c", "site_d")
NEVER_MEASURED = {"site_a": ("x3", "x13"), "site_b": ("x7",)}
RARELY_MEASURED = {"site_b": ("x20",)}  # measured for 5% of the site's rows
RARE_CLASS_SITE = "site_c"
RARE_CLASS_SHARE = 0.05
TEST_SHARE = 0.2


@dataclass(frozen=True)
class Sites:
    """Training parties plus the pooled held-out rows of every site."""

    parties: list[PartyData]
    test_features: np.ndarray
    test_labels: np.ndarray


def breast_table() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    frames = []
    for name in BREAST_FILES:
        with gzip.open(DATA / f"{name}.csv.gz", "rt") as handle:
            frames.append(pd.read_csv(handle))
    table = pd.concat(frames, ignore_index=True).sort_values("id", kind="stable")
    columns = tuple(c for c in table.columns if c not in ("id", "y"))
    return table[list(columns)].to_numpy(float), table["y"].to_numpy(np.int8), columns


def pathological_sites(
    features: np.ndarray,
    labels: np.ndarray,
    columns: tuple[str, ...],
    rng: np.random.Generator,
) -> Sites:
    """Split rows over ``SITES`` and give them the module's pathologies."""
    medians = np.median(features, axis=0)
    order = rng.permutation(len(labels))
    parties, tests_x, tests_y = [], [], []
    for name, rows in zip(SITES, np.array_split(order, len(SITES)), strict=True):
        x, y = features[rows].copy(), labels[rows].copy()
        if name == RARE_CLASS_SITE:
            x, y = _make_rare(x, y, rng)
        for column in NEVER_MEASURED.get(name, ()):
            x[:, columns.index(column)] = medians[columns.index(column)]
        for column in RARELY_MEASURED.get(name, ()):
            filled = rng.random(len(y)) > RARE_CLASS_SHARE
            x[filled, columns.index(column)] = medians[columns.index(column)]
        test = _stratified_test_rows(y, rng)
        train = np.setdiff1d(np.arange(len(y)), test)
        parties.append(PartyData(name, x[train], y[train], columns))
        tests_x.append(x[test])
        tests_y.append(y[test])
    return Sites(parties, np.vstack(tests_x), np.concatenate(tests_y))


def breast_sites(seed: int) -> Sites:
    features, labels, columns = breast_table()
    return pathological_sites(features, labels, columns, np.random.default_rng(seed))


def synthetic_sites(seed: int, d: int = 24, rows_per_site: int = 200) -> Sites:
    """Gaussian classes (AR(0.6) covariance, shift 1 on three features), same pathologies."""
    rng = np.random.default_rng(seed)
    index = np.arange(d)
    chol = np.linalg.cholesky(0.6 ** np.abs(index[:, None] - index[None, :]))
    n = rows_per_site * len(SITES)
    labels = (rng.random(n) < 0.5).astype(np.int8)
    shift = np.zeros(d)
    shift[:3] = 1.0
    features = rng.standard_normal((n, d)) @ chol.T + np.where(labels[:, None] == 0, shift, 0)
    columns = tuple(f"x{k}" for k in range(d))
    return pathological_sites(features, labels, columns, rng)


STRESS_KINDS = ("tiny class", "few rows", "unmeasured", "duplicate", "plain")


def stressed_sites(seed: int) -> Sites:
    """The breast rows over 3 to 6 sites of random sizes (at least 40 rows before a site is
    made awkward), each given one of ``STRESS_KINDS``:
    its minority class cut to 2-4 rows, only 8 rows of each class (p > n), 1-5 columns never
    measured, a column duplicated to 1e-9 plus one measured for 5% of patients, or nothing."""
    features, labels, columns = breast_table()
    rng = np.random.default_rng(seed)
    medians = np.median(features, axis=0)
    sites = int(rng.integers(3, 7))
    spare = rng.multinomial(len(labels) - 40 * sites, rng.dirichlet(np.ones(sites)))
    cuts = np.cumsum(40 + spare)[:-1]
    parties, tests_x, tests_y = [], [], []
    for k, rows in enumerate(np.split(rng.permutation(len(labels)), cuts)):
        x, y = features[rows].copy(), labels[rows].copy()
        kind = STRESS_KINDS[int(rng.integers(len(STRESS_KINDS)))]
        if kind in ("tiny class", "few rows"):
            minority = int(np.count_nonzero(y == 1) < np.count_nonzero(y == 0))
            keep = [np.flatnonzero(y == label)[:8] for label in (0, 1)]
            if kind == "tiny class":
                keep[minority] = np.flatnonzero(y == minority)[: rng.integers(2, 5)]
                keep[1 - minority] = np.flatnonzero(y != minority)
            kept = np.sort(np.concatenate(keep))
            x, y = x[kept], y[kept]
        elif kind == "unmeasured":
            for column in rng.choice(len(columns), rng.integers(1, 6), replace=False):
                x[:, column] = medians[column]
        elif kind == "duplicate":
            copy, source = rng.choice(len(columns), 2, replace=False)
            x[:, copy] = x[:, source] + 1e-9 * rng.standard_normal(len(y))
            rare = (copy + 1) % len(columns)
            x[rng.random(len(y)) > RARE_CLASS_SHARE, rare] = medians[rare]
        test = _stratified_test_rows(y, rng)
        train = np.setdiff1d(np.arange(len(y)), test)
        parties.append(PartyData(f"site_{k}", x[train], y[train], columns))
        tests_x.append(x[test])
        tests_y.append(y[test])
    return Sites(parties, np.vstack(tests_x), np.concatenate(tests_y))


def _make_rare(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple:
    """Keep every row of the site's majority class and ~5% (at least 3) of the other."""
    minority = int(np.count_nonzero(y == 1) < np.count_nonzero(y == 0))
    majority_rows = np.flatnonzero(y != minority)
    wanted = max(3, round(RARE_CLASS_SHARE * len(majority_rows) / (1 - RARE_CLASS_SHARE)))
    kept = rng.choice(np.flatnonzero(y == minority), size=wanted, replace=False)
    rows = np.sort(np.concatenate([majority_rows, kept]))
    return x[rows], y[rows]


def _stratified_test_rows(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """20% of each class, at least one row, leaving at least two rows of each for training."""
    chosen = []
    for label in (0, 1):
        rows = np.flatnonzero(y == label)
        count = min(max(1, round(TEST_SHARE * len(rows))), len(rows) - 2)
        chosen.append(rng.choice(rows, size=max(count, 0), replace=False))
    return np.sort(np.concatenate(chosen))
