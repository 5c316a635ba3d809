"""The encrypted one-shot WALR sum on FATE's default_credit, timed step by step.

Usage: python benchmarks/bench_walr_protocol.py [--rows N] [--key-size 2048] [--mode clipped]
       [--randomizer full|short|standard]

The labels party holds the guest's ``y`` (30,000 rows), the features party the host's ten
standardised features of the same rows (joined on ``id``, standing in for a PSI alignment).
Steps, each the function the flow's task calls: the labels party's key pair and ``[[y]]``; the
features party's ``X^T [[y]]`` on the integer grid, mask and re-randomisation; the labels
party's decryption; the features party's unmasking. The unmasked sum must equal the plaintext
``y @ grid_units`` exactly, or the script exits non-zero. Clipped mode uses C = the 90th
percentile of row norms (a feature-only choice); binary mode uses ``x > 0``.
Times are wall-clock seconds on whatever the machine is doing meanwhile, beside the CPU
seconds of this process and its pool workers: on an idle two-core machine a step takes about
max(CPU / 2, its serial part), so a busy shared machine can be told apart from slow code.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil

from core.paillier import cipher
from core.paillier.keys import MIN_SECURE_KEY_BITS, generate_keypair
from core.paillier.randomness import DEFAULT_RANDOMIZER
from core.walr import WalrFeatures, prepare_binary_features, prepare_clipped_features

DATA = Path(__file__).resolve().parent / "data" / "fate"


def load(rows: int | None) -> tuple[pd.DataFrame, np.ndarray]:
    guest = pd.read_csv(DATA / "default_credit_hetero_guest.csv.gz")[["id", "y"]]
    host = pd.read_csv(DATA / "default_credit_hetero_host.csv.gz")
    joined = guest.merge(host, on="id", validate="one_to_one")
    if rows is not None:
        joined = joined.head(rows)
    return joined.drop(columns=["id", "y"]), joined["y"].to_numpy(dtype=np.int64)


def prepare(features: pd.DataFrame, mode: str) -> WalrFeatures:
    if mode == "binary":
        return prepare_binary_features((features > 0).astype(float))
    clip = float(np.quantile(np.linalg.norm(features.to_numpy(), axis=1), 0.9))
    return prepare_clipped_features(features, clip)


def cpu_seconds() -> float:
    """CPU seconds so far of this process and its children (the encryption pool's workers)."""
    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def timed(rows: list[dict[str, Any]], step: str, party: str, call: Callable[[], Any]) -> Any:
    cpu, started = cpu_seconds(), time.perf_counter()
    result = call()
    seconds = time.perf_counter() - started
    rows.append({"step": step, "party": party, "seconds": seconds, "cpu": cpu_seconds() - cpu})
    return result


def run(
    rows_wanted: int | None, key_size: int, mode: str, randomizer: str
) -> tuple[list[dict[str, Any]], bool]:
    frame, labels = load(rows_wanted)
    features = prepare(frame, mode)
    grid = features.grid_units()
    steps: list[dict[str, Any]] = []
    public, private = timed(
        steps,
        "key pair",
        "labels",
        lambda: generate_keypair(key_size, allow_insecure_key_size=key_size < MIN_SECURE_KEY_BITS),
    )
    encrypted = timed(  # as the flow does: its own key, so the CRT path
        steps,
        "[[y]]",
        "labels",
        lambda: cipher.encrypt(public, labels.tolist(), randomizer, private=private),
    )
    sums = timed(
        steps, "X^T [[y]]", "features", lambda: cipher.transpose_dot(public, grid, encrypted)
    )
    masks = cipher.random_masks(len(sums))
    hidden = timed(
        steps,
        "mask + re-randomise",
        "features",
        lambda: cipher.rerandomize(public, cipher.add_plain(public, sums, masks), randomizer),
    )
    masked = timed(steps, "decrypt", "labels", lambda: cipher.decrypt(private, hidden))
    unmasked = [m - r for m, r in zip(masked, masks, strict=True)]
    exact = (labels @ grid).tolist()
    return steps, unmasked == exact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="first N rows (default: all)")
    parser.add_argument("--key-size", type=int, default=2048)
    parser.add_argument("--mode", choices=("clipped", "binary"), default="clipped")
    parser.add_argument("--randomizer", default=DEFAULT_RANDOMIZER)
    args = parser.parse_args(argv)
    steps, equal = run(args.rows, args.key_size, args.mode, args.randomizer)
    total = sum(s["seconds"] for s in steps)
    print(
        f"WALR one-shot encrypted sum: {args.rows or 'all'} rows, {args.mode}, "
        f"{args.key_size}-bit key, randomizer {args.randomizer!r}\n"
    )
    print("| step | party | seconds | CPU s, all processes |\n|---|---|---|---|")
    for s in steps:
        print(f"| {s['step']} | {s['party']} | {s['seconds']:.2f} | {s['cpu']:.2f} |")
    print(f"| total | | {total:.2f} | {sum(s['cpu'] for s in steps):.2f} |\n")
    print(f"unmasked sum equals plaintext y @ grid_units: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
