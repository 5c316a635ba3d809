"""Label-DP regression on FATE's dvisits and student data: RR-on-Bins beside the baselines.

Usage: python benchmarks/bench_labeldp.py [--quick] [--repeats R]

Like Table 1 of Ghazi et al. (ICLR 2023): for each epsilon, the MSE between the noisy and the
true training labels ("mechanism") and the test MSE of a model trained on the noisy labels
("generalisation"), medians over R repetitions (each a fresh 80/20 split and fresh noise).

* dvisits: guest and host joined on ``id``; label ``doctorco`` on the declared range 0..9
  (integer grid); Poisson loss, PoissonRegressor.
* student: guest and host joined on ``id``; label ``y`` (grade) on 0..20; squared loss, Ridge.

RR-on-Bins spends part of epsilon on a private prior (default split, see
``core.label_dp.prior``); the baselines get the whole epsilon: clipped discrete Laplace, the
calibrated exponential mechanism (utility -loss) and the clipped discrete staircase (step
width chosen for a uniform prior, so no label information is used). All noise comes from the
OS CSPRNG, so numbers move slightly between runs. Ends with the time RR-on-Bins takes to
optimise 1,000 and 10,000 distinct label values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.label_dp import (
    clipped_laplace,
    exponential_mechanism,
    label_grid,
    release_labels,
    rr_on_bins,
    staircase_mechanism,
    train_on_noisy_labels,
)

DATA = Path(__file__).resolve().parent / "data" / "fate"
EPSILONS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
MECHANISMS = ("RR-on-Bins", "Laplace", "Exponential", "Staircase")


@dataclass(frozen=True)
class Dataset:
    name: str
    stem: str
    label: str
    loss: str
    low: int
    high: int


DATASETS = (
    Dataset("dvisits", "dvisits_hetero", "doctorco", "poisson", 0, 9),
    Dataset("student", "student_hetero", "y", "squared", 0, 20),
)


def load(dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Features (guest and host joined on id) and labels."""
    guest = pd.read_csv(DATA / f"{dataset.stem}_guest.csv.gz")
    host = pd.read_csv(DATA / f"{dataset.stem}_host.csv.gz")
    joined = guest.merge(host, on="id", suffixes=("_guest", "_host"))
    labels = joined.pop(dataset.label).to_numpy(dtype=np.float64)
    return joined.drop(columns="id").to_numpy(dtype=np.float64), labels


def noisy_labels(mechanism: str, labels: np.ndarray, dataset: Dataset, epsilon: float):
    """The training labels after one mechanism with the whole budget ``epsilon``."""
    grid = label_grid(dataset.low, dataset.high, integer=True)
    snapped = grid.snap(labels)
    if mechanism == "RR-on-Bins":
        return release_labels(snapped, grid, epsilon, dataset.loss).noisy_labels
    factories: dict[str, Callable] = {
        "Laplace": clipped_laplace,
        "Exponential": exponential_mechanism,
        "Staircase": staircase_mechanism,
    }
    return factories[mechanism](grid.points, epsilon, dataset.loss).randomize(snapped)


def one_repetition(dataset: Dataset, features, labels, epsilon: float, seed: int):
    """``{mechanism: (mechanism MSE, test MSE)}`` for one split and one noise draw."""
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.2, random_state=seed
    )
    scores = {}
    for mechanism in MECHANISMS:
        noisy = noisy_labels(mechanism, y_train, dataset, epsilon)
        model = train_on_noisy_labels(x_train, noisy, dataset.loss)
        scores[mechanism] = (
            float(np.mean((noisy - y_train) ** 2)),
            float(np.mean((model.predict(x_test) - y_test) ** 2)),
        )
    return scores


def non_private_test_mse(dataset: Dataset, features, labels, repeats: int) -> float:
    errors = []
    for seed in range(repeats):
        x_train, x_test, y_train, y_test = train_test_split(
            features, labels, test_size=0.2, random_state=seed
        )
        model = train_on_noisy_labels(x_train, y_train, dataset.loss)
        errors.append(float(np.mean((model.predict(x_test) - y_test) ** 2)))
    return statistics.median(errors)


def fmt(value: float) -> str:
    return f"{value:.4g}"


def table_for(dataset: Dataset, repeats: int) -> list[str]:
    """Print the dataset's table; return the cases where RR-on-Bins is not the best."""
    features, labels = load(dataset)
    clean = non_private_test_mse(dataset, features, labels, repeats)
    print(
        f"\n### {dataset.name}: n={len(labels)}, label `{dataset.label}` on "
        f"{dataset.low}..{dataset.high}, {dataset.loss} loss; "
        f"medians of {repeats}; non-private test MSE {fmt(clean)}\n"
    )
    header = " | ".join(f"mech {m}" for m in MECHANISMS) + " | "
    header += " | ".join(f"test {m}" for m in MECHANISMS)
    print(f"| eps | {header} |")
    print("|" + "---|" * (1 + 2 * len(MECHANISMS)))
    losses = []
    for epsilon in EPSILONS:
        runs = [one_repetition(dataset, features, labels, epsilon, s) for s in range(repeats)]
        medians = {
            m: tuple(statistics.median(run[m][i] for run in runs) for i in (0, 1))
            for m in MECHANISMS
        }
        cells = [fmt(medians[m][0]) for m in MECHANISMS] + [fmt(medians[m][1]) for m in MECHANISMS]
        print(f"| {epsilon:g} | " + " | ".join(cells) + " |")
        for column, what in ((0, "mechanism MSE"), (1, "test MSE")):
            winner = min(MECHANISMS, key=lambda m, c=column: medians[m][c])
            if medians[winner][column] < medians["RR-on-Bins"][column]:
                best, ours = medians[winner][column], medians["RR-on-Bins"][column]
                losses.append(
                    f"{dataset.name} eps={epsilon:g} {what}: {winner} {fmt(best)} "
                    f"< RR-on-Bins {fmt(ours)}"
                )
    return losses


def kernel_timings(sizes_and_runs: list[tuple[int, int]]) -> None:
    """Median wall time of ``rr_on_bins`` for k distinct values (random prior, eps = 1)."""
    print("\n### RR-on-Bins optimisation time (random Dirichlet prior, eps = 1)\n")
    print("| distinct values | loss | runs | median s | bins |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for size, runs in sizes_and_runs:
        values = np.sort(rng.choice(100 * size, size=size, replace=False)).astype(np.float64)
        prior = rng.dirichlet(np.ones(size))
        for loss in ("squared", "poisson", "absolute"):
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                mechanism = rr_on_bins(values, prior, 1.0, loss)
                times.append(time.perf_counter() - start)
            print(
                f"| {size:,} | {loss} | {runs} | {statistics.median(times):.3f} | "
                f"{mechanism.bin_count} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, fewer timings")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per epsilon")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 10)
    not_won = []
    for dataset in DATASETS:
        not_won += table_for(dataset, repeats)
    print("\n### Where RR-on-Bins does not win (median)\n")
    print("\n".join(f"- {line}" for line in not_won) if not_won else "- nowhere")
    kernel_timings([(1_000, 3), (10_000, 1)] if args.quick else [(1_000, 5), (10_000, 3)])


if __name__ == "__main__":
    main()
