"""Vertical LR: quality beside scikit-learn, and seconds per epoch beside straightforward phe.

Usage: python benchmarks/bench_vertical.py [--rows N] [--epochs-quality E]

Quality: train AUC of the protocol's arithmetic (``core.vertical_lr.reference``, which the
tests prove equal to the encrypted protocol bit for bit) against scikit-learn's
LogisticRegression on the joined data, on FATE's breast and default_credit hetero files.

Speed: one epoch of every party's cryptographic work on default_credit (2048-bit key,
one host, mini-batches of 4,096) with privreg's Paillier layer, beside the straightforward
phe implementation of the same protocol (encrypt each value with phe, obfuscate [[d]], one
``ciphertext * float`` per feature and row, sum). Both are timed on the first ``--rows`` rows
of the same run and scaled linearly to 30,000 rows (the work is linear in rows).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
from phe import paillier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from core.paillier import cipher
from core.paillier.keys import generate_keypair
from core.vertical_lr.fixed_point import encode_features
from core.vertical_lr.reference import train_reference, with_intercept
from core.vertical_lr.schedule import Schedule
from core.vertical_lr.steps import (
    Optimizer,
    guest_shares,
    host_share,
    labels_pm1,
    loss_coefficients,
)

DATA = Path(__file__).resolve().parent / "data" / "fate"
TRAINING = {  # the settings the pipeline and deployments use for each data set
    "breast": {
        "batch_size": 569,
        "epochs": 40,
        "learning_rate": 0.15,
        "momentum": 0.9,
        "clip": None,
    },
    "default_credit": {
        "batch_size": 4096,
        "epochs": 10,
        "learning_rate": 0.5,
        "momentum": 0.9,
        "clip": 3.0,
    },
}


def load(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    guest = pd.read_csv(DATA / f"{name}_hetero_guest.csv.gz")
    host = pd.read_csv(DATA / f"{name}_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    guest_X = guest[[c for c in guest.columns if c.startswith("x")]].to_numpy()
    return guest_X, host.to_numpy(), guest["y"].to_numpy()


def quality_rows() -> list[str]:
    rows = []
    for name, options in TRAINING.items():
        raw_guest, raw_host, y = load(name)
        clip = options["clip"] or np.inf
        guest_X, host_X = np.clip(raw_guest, -clip, clip), np.clip(raw_host, -clip, clip)
        schedule = Schedule(len(y), options["batch_size"], 0, holdout_fraction=0.0)
        optimizer = Optimizer(options["learning_rate"], options["momentum"], 0.0, 0.0)
        result = train_reference(guest_X, [host_X], y, schedule, options["epochs"], optimizer)
        scores = with_intercept(guest_X) @ result.guest_weights + host_X @ result.host_weights[0]
        ours = roc_auc_score(y, scores)
        joined = np.hstack([raw_guest, raw_host])  # scikit-learn sees the raw joined data
        sklearn = roc_auc_score(
            y, LogisticRegression(max_iter=2000).fit(joined, y).decision_function(joined)
        )
        rows.append(
            f"| {name} | {len(y):,} | {options['epochs']} x batch {options['batch_size']}"
            f" | {ours:.4f} | {sklearn:.4f} | {100 * (ours - sklearn) / sklearn:+.2f}% |"
        )
    return rows


def privreg_epoch(public, private, guest_X, host_X, y, randomizer: str, batch: int) -> float:
    """Every party's crypto work for one epoch over the given rows (weights held fixed)."""
    Xg = with_intercept(guest_X)
    wg, wh = np.full(Xg.shape[1], 0.01), np.full(host_X.shape[1], 0.01)
    started = time.perf_counter()
    for start in range(0, len(y), batch):
        rows = slice(start, start + batch)
        yb = labels_pm1(y[rows])
        share = host_share(host_X[rows], wh)
        encrypted = cipher.encrypt(public, share, randomizer)  # host
        square = cipher.encrypt(public, [sum(a * a for a in share)], randomizer)
        b, q = guest_shares(Xg[rows], wg, yb)  # guest
        coefficients, constant = loss_coefficients(q, yb)
        loss = cipher.weighted_sum(public, [*encrypted, *square], [*coefficients, 1])
        loss = cipher.rerandomize(public, cipher.add_plain(public, [loss], [constant]), randomizer)
        residual = cipher.rerandomize(public, cipher.add_plain(public, encrypted, b), randomizer)
        for X in (Xg[rows], host_X[rows]):  # guest, then host
            gradient = cipher.transpose_dot(public, encode_features(X), residual)
            masks = cipher.random_masks(len(gradient))
            cipher.decrypt(private, cipher.add_plain(public, gradient, masks))  # key holder
        cipher.decrypt(private, loss)
    return time.perf_counter() - started


def phe_epoch(public, private, guest_X, host_X, y, batch: int) -> float:
    """The same protocol written the straightforward way with phe's EncryptedNumber."""
    Xg = with_intercept(guest_X)
    wg, wh = np.full(Xg.shape[1], 0.01), np.full(host_X.shape[1], 0.01)
    started = time.perf_counter()
    for start in range(0, len(y), batch):
        rows = slice(start, start + batch)
        yb = labels_pm1(y[rows])
        encrypted = [public.encrypt(float(v)) for v in host_X[rows] @ wh / 4]  # host
        residual = [
            c + float(g) for c, g in zip(encrypted, Xg[rows] @ wg / 4 - yb / 2, strict=True)
        ]  # guest
        for c in residual:
            c.obfuscate()
        for X in (Xg[rows], host_X[rows]):
            gradient = [
                sum(c * float(x) for c, x in zip(residual, column, strict=True)) for column in X.T
            ]
            masked = [g + public.encrypt(0.0) for g in gradient]
            [private.decrypt(g) for g in masked]
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2000, help="rows timed (scaled to 30,000)")
    parser.add_argument("--phe-rows", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    print("\n### Quality: train AUC, protocol arithmetic vs scikit-learn (joined data)\n")
    print("| data | rows | training | privreg | scikit-learn | difference |")
    print("|---|---|---|---|---|---|")
    print("\n".join(quality_rows()))

    guest_X, host_X, y = load("default_credit")
    public, private = generate_keypair(2048)
    scale = len(y) / args.rows
    timings: dict[str, list[float]] = {
        "privreg, standard r^n": [],
        "privreg, DJN randomizer": [],
        "phe, straightforward": [],
    }
    for _ in range(args.repeats):
        subset = (guest_X[: args.rows], host_X[: args.rows], y[: args.rows])
        timings["privreg, standard r^n"].append(
            scale * privreg_epoch(public, private, *subset, "standard", 4096)
        )
        timings["privreg, DJN randomizer"].append(
            scale * privreg_epoch(public, private, *subset, "djn", 4096)
        )
        small = (guest_X[: args.phe_rows], host_X[: args.phe_rows], y[: args.phe_rows])
        timings["phe, straightforward"].append(
            len(y)
            / args.phe_rows
            * phe_epoch(paillier.PaillierPublicKey(public.n), private, *small, 4096)
        )
    baseline = statistics.median(timings["phe, straightforward"])
    print(
        f"\n### Seconds per epoch, default_credit 30,000 rows x (13+1 guest, 10 host), "
        f"2048-bit, scaled from {args.rows:,} rows (phe from {args.phe_rows})\n"
    )
    print("| implementation | s / epoch | speed-up vs phe |")
    print("|---|---|---|")
    for name, samples in timings.items():
        median = statistics.median(samples)
        print(f"| {name} | {median:,.1f} | {baseline / median:.1f}x |")


if __name__ == "__main__":
    main()
