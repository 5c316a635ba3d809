"""Horizontal logistic regression with secure aggregation: model quality and masking cost.

Usage: python benchmarks/bench_horizontal.py [--quick]

1. Held-out AUC on FATE's homo example data (breast: 2 parties, default_credit: 3 parties),
   trained with one secure aggregation per round, beside scikit-learn LogisticRegression
   (C=1) on the pooled rows. The L2 weight 1/N mirrors C=1 for the mean log-loss.
2. Seconds for one party to mask one round (fixed-point encoding + self mask + 9 pairwise
   masks) with 10 parties, and for the coordinator to unmask with 3 of 10 parties dropped
   (their pairwise masks rebuilt from Shamir shares of their mask keys).

Timings are medians over repeats; the machine may be shared, so expect noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.horizontal_lr import (
    party_arrays,
    predict_proba,
    train_federated,
    validate_party_tables,
)
from core.secagg import (
    advertise_keys,
    collect_key_advertisements,
    collect_masked_inputs,
    mask_input,
    new_session,
    reconstruct_sum,
    reveal_shares,
    route_encrypted_shares,
    share_keys,
    start_coordinator,
)
from core.secagg.fixed_point import decode

DATA = Path(__file__).resolve().parent / "data" / "fate"
DATASETS = {
    "breast": (["breast_homo_guest", "breast_homo_host"], "breast_homo_test", 0.9873),
    "default_credit": (
        ["default_credit_homo_guest", "default_credit_homo_host_1", "default_credit_homo_host_2"],
        "default_credit_homo_test",
        0.7304,
    ),
}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def auc_rows(quick: bool) -> list[list[object]]:
    rounds = {
        "gradient averaging": (40 if quick else 100, 0),
        "FedAvg, 5 local epochs": (10 if quick else 30, 5),
    }
    rows: list[list[object]] = []
    for name, (party_files, test_file, reference) in DATASETS.items():
        tables = {f: pd.read_csv(DATA / f"{f}.csv.gz") for f in party_files}
        features = validate_party_tables(tables, label="y", id_column="id")
        parties = [party_arrays(t, features) for t in tables.values()]
        X_test, y_test = party_arrays(pd.read_csv(DATA / f"{test_file}.csv.gz"), features)
        X_pool = np.vstack([X for X, _ in parties])
        y_pool = np.concatenate([y for _, y in parties])
        baseline = LogisticRegression(C=1.0, max_iter=2000).fit(X_pool, y_pool)
        sklearn_auc = roc_auc_score(y_test, baseline.predict_proba(X_test)[:, 1])
        for mode, (iterations, epochs) in rounds.items():
            start = time.perf_counter()
            fit = train_federated(
                parties,
                iterations,
                learning_rate=1.0,
                l2=1.0 / len(y_pool),
                epochs_per_round=epochs,
            )
            seconds = time.perf_counter() - start
            auc = roc_auc_score(y_test, predict_proba(fit.weights, X_test))
            rows.append(
                [
                    name,
                    len(parties),
                    len(y_pool),
                    f"{mode}, {iterations} rounds",
                    f"{auc:.4f}",
                    f"{sklearn_auc:.4f}",
                    f"{reference:.4f}",
                    f"{100 * (auc - sklearn_auc) / sklearn_auc:+.2f}%",
                    f"{100 * (auc - reference) / reference:+.2f}%",
                    f"{seconds:.2f}",
                ]
            )
    return rows


def masking_rows(dimension: int, repeats: int, n: int = 10, dropped: int = 3) -> list[list[object]]:
    names = [f"org-{i}" for i in range(n)]
    config = new_session("bench", names, threshold=n // 2 + 1, dimension=dimension)
    rng = np.random.default_rng(1)
    updates = {name: rng.normal(size=dimension) for name in names}

    coordinator = start_coordinator(config)
    states, advertisements = {}, []
    for name in names:
        states[name], message = advertise_keys(config, name)
        advertisements.append(message)
    coordinator, directory = collect_key_advertisements(coordinator, advertisements)
    share_times, share_messages = [], []
    for name in names:
        start = time.perf_counter()
        states[name], message = share_keys(states[name], directory)
        share_times.append(time.perf_counter() - start)
        share_messages.append(message)
    coordinator, deliveries = route_encrypted_shares(coordinator, share_messages)

    mask_times = [
        median_seconds(
            lambda name=name: mask_input(states[name], deliveries[name], updates[name]), repeats
        )
        for name in names
    ]
    senders = names[dropped:]
    masked = []
    for name in senders:
        states[name], message = mask_input(states[name], deliveries[name], updates[name])
        masked.append(message)
    coordinator, request = collect_masked_inputs(coordinator, masked)
    responses = []
    for name in senders:
        states[name], response = reveal_shares(states[name], request)
        responses.append(response)
    unmask_seconds = median_seconds(lambda: reconstruct_sum(coordinator, responses), repeats)
    _, aggregate = reconstruct_sum(coordinator, responses)
    error = np.max(np.abs(decode(aggregate["ring_sum"]) - sum(updates[s] for s in senders)))
    assert error < n * 2.0**-24, f"unmasked sum is wrong (max error {error})"

    return [
        [
            f"party: share keys (Shamir + encrypt for {n - 1} peers)",
            n,
            f"{statistics.median(share_times):.4f}",
        ],
        [
            f"party: mask one round ({n - 1} pairwise + self mask, encode)",
            n,
            f"{statistics.median(mask_times):.4f}",
        ],
        [
            f"coordinator: unmask, {dropped} of {n} dropped (max abs error {error:.1e})",
            n,
            f"{unmask_seconds:.4f}",
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 100k-dim masking")
    args = parser.parse_args()

    print("## Held-out AUC, secure aggregation vs scikit-learn on pooled rows\n")
    headers = [
        "data",
        "parties",
        "train rows",
        "mode",
        "secagg AUC",
        "sklearn AUC",
        "FATE ref.",
        "vs sklearn",
        "vs ref.",
        "seconds",
    ]
    print(markdown_table(headers, auc_rows(args.quick)))

    dimension = 100_000 if args.quick else 1_000_000
    rows = masking_rows(dimension, repeats=3 if args.quick else 5)
    print(f"\n## Secure aggregation, 10 parties, {dimension:,}-dim update (median seconds)\n")
    print(markdown_table(["step", "parties", "seconds"], rows))


if __name__ == "__main__":
    main()
