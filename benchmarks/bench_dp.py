"""Horizontal LR under distributed differential privacy: held-out AUC against epsilon, and the
cost of a round with and without the noise.

Usage: python benchmarks/bench_dp.py [--repeats 20] [--cost-rounds 30] [--flow-rounds 10]
       [--flow-repeats 2]

1. Held-out AUC at epsilon 0.5, 1, 2, 4, 8 (delta 1e-5, every round composed) on the demo's
   three hospitals and on FATE's default_credit homo files split into ten sites, three ways:
   * none: today's model (full-batch gradient descent, the secure sum's exact mean);
   * central: a trusted curator adds continuous Gaussian noise once to the same clipped sums
     (sigma from the analytic Gaussian calibration of all rounds composed: the tightest);
   * distributed: each site adds its discrete Gaussian share in the secure sum's ring
     (``core.dp.distributed``: sigma from the proven zCDP bound, split into ``t`` shares so any
     ``t`` senders carry it; with all sites sending the sum holds ``n / t`` times the
     variance). The ring sum of the sites' noisy inputs is what the secure sum unmasks (masks
     cancel exactly; their cost is measured in part 2).
   Each cell is the mean over ``--repeats`` noise draws (its standard deviation beside it).
   Features of the demo are standardised already; default_credit's are standardised with the
   statistics of its separate test file (public to this benchmark), so no training row shapes
   the scaling.
2. A round at ten sites through the multi-round secure sum (``core.secagg.simulation``): every
   site computes its update, encodes and masks it, answers the unmasking, the coordinator
   unmasks; with DP the update is clipped per row and a noise share is drawn. Medians of
   ``--cost-rounds`` rounds. All ten sites run one after another in this one process, so
   the noise's cost is counted ten times here, where a deployment's sites draw in parallel.
3. The real flows at ten hospitals, each its own process over mutual TLS on loopback (the
   demo's rows dealt round-robin, ``privreg party horizontal``, as ``make bench-horizontal``
   runs them), with and without ``--dp-epsilon``: the median round from one round's start to
   the next (``--flow-rounds`` rounds, ``--flow-repeats`` runs of each, in turn; skip with
   ``--flow-rounds 0``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import horizontal_lr as hlr
from core.dp import distributed as dd
from core.dp.gaussian import analytic_gaussian_sigma
from core.secagg import default_threshold
from core.secagg import multiround as mr
from core.secagg.fixed_point import DEFAULT_SCALE_BITS, decode, encode
from core.secagg.simulation import run_round, start_job

ROOT = Path(__file__).resolve().parents[1]
FATE = ROOT / "benchmarks" / "data" / "fate"
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
DELTA = 1e-5
L2 = 1e-3
Site = tuple[np.ndarray, np.ndarray]


def demo_sites(seed: int = 0) -> tuple[list[Site], Site]:
    """The demo's three hospitals, a quarter of each held out (pooled for the AUC)."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for name in ("hospital_a", "hospital_b", "hospital_c"):
        frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")
        X = frame.drop(columns=["patient_id", "diagnosis"]).to_numpy(float)
        y = frame["diagnosis"].to_numpy(float)
        held = rng.random(len(y)) < 0.25
        train.append((X[~held], y[~held]))
        test.append((X[held], y[held]))
    return train, (np.vstack([X for X, _ in test]), np.concatenate([y for _, y in test]))


def credit_sites(sites: int = 10) -> tuple[list[Site], Site]:
    """FATE's default_credit homo files (3 x 8,000 rows) split into ``sites`` sites; its test
    file (6,000 rows) held out and its statistics used for the scaling."""

    def read(name: str) -> Site:
        frame = pd.read_csv(FATE / f"{name}.csv.gz")
        return frame.drop(columns=["id", "y"]).to_numpy(float), frame["y"].to_numpy(float)

    parts = [read(n) for n in ("default_credit_homo_guest", "default_credit_homo_host_1",
                               "default_credit_homo_host_2")]  # fmt: skip
    X_test, y_test = read("default_credit_homo_test")
    mean, scale = X_test.mean(axis=0), X_test.std(axis=0) + 1e-12
    X = (np.vstack([X for X, _ in parts]) - mean) / scale
    y = np.concatenate([y for _, y in parts])
    chunks = np.array_split(np.arange(len(y)), sites)
    return [(X[c], y[c]) for c in chunks], ((X_test - mean) / scale, y_test)


# ---------------------------------------------------------------------------------------------
# Training, three ways (one gradient a round)

Summer = Callable[[list[np.ndarray], np.ndarray], np.ndarray]


def train(
    sites: list[Site], rounds: int, rate: float, dp_sum: Summer | None, clip: float = 1.0
) -> np.ndarray:
    """Gradient descent from zero; ``dp_sum`` turns the sites' clipped vectors into the round's
    released sum (None: today's exact weighted mean of unclipped gradients)."""
    weights = hlr.init_model(sites[0][0].shape[1])
    for _ in range(rounds):
        if dp_sum is None:
            packed = [hlr.local_gradient(weights, X, y, L2).packed() for X, y in sites]
            mean = hlr.round_mean(np.sum(packed, axis=0), weights, L2).mean
        else:
            vectors = [hlr.clipped_contribution(weights, X, y, clip) for X, y in sites]
            mean = hlr.round_mean(dp_sum(vectors, weights), weights, L2, clip).mean
        weights = hlr.apply_mean_gradient(weights, mean, rate)
    return weights


def central_sum(epsilon: float, rounds: int, clip: float, rng: np.random.Generator) -> Summer:
    """A trusted curator's release: the exact clipped sum plus one continuous Gaussian."""
    sigma = analytic_gaussian_sigma(epsilon, DELTA, math.sqrt(rounds) * hlr.dp_sensitivity(clip))

    def release(vectors: list[np.ndarray], _: np.ndarray) -> np.ndarray:
        total = np.sum(vectors, axis=0)
        total[:-1] += rng.normal(0.0, sigma, total.size - 1)  # the row count stays exact
        return total

    release.sigma = sigma  # type: ignore[attr-defined]
    return release


def distributed_noise(
    epsilon: float, rounds: int, sites: int, dimension: int, clip: float
) -> dd.DistributedGaussian:
    """The noise the flow calibrates: t = a strict majority, no colluders."""
    sensitivity = dd.grid_sensitivity(hlr.dp_sensitivity(clip), DEFAULT_SCALE_BITS, dimension)
    honest = dd.honest_shares(default_threshold(sites), 0)
    return dd.calibrate(epsilon, DELTA, sensitivity, rounds, honest, dimension)


def distributed_sum(noise: dd.DistributedGaussian, clip: float) -> Summer:
    """What the secure sum unmasks: every site's clipped vector with its noise share, in the
    ring (masks cancel exactly), decoded."""

    def release(vectors: list[np.ndarray], _: np.ndarray) -> np.ndarray:
        n = len(vectors)
        ring = sum(hlr.noisy_ring_input(v, noise, n, DEFAULT_SCALE_BITS, clip) for v in vectors)
        return decode(ring, DEFAULT_SCALE_BITS)

    return release


def auc(weights: np.ndarray, test: Site) -> float:
    return float(roc_auc_score(test[1], hlr.predict_proba(weights, test[0])))


def accuracy_table(name: str, sites: list[Site], test: Site, rounds: int, rate: float,
                   clip: float, repeats: int) -> None:  # fmt: skip
    dimension = sites[0][0].shape[1] + 3
    n, t = len(sites), default_threshold(len(sites))
    plain = auc(train(sites, rounds, rate, None), test)
    rows = sum(len(y) for _, y in sites)
    print(f"\n{name}: {n} sites, {rows} training rows, {len(test[1])} held out; {rounds} rounds, "
          f"learning rate {rate}, clip {clip}, threshold t = {t}")  # fmt: skip
    clipped = auc(train(sites, rounds, rate, lambda v, _: np.sum(v, axis=0), clip), test)
    print(f"  no DP: held-out AUC {plain:.4f}; clipped rows, no noise: {clipped:.4f}")
    print(
        "  epsilon | central AUC (sd) | distributed AUC (sd) | gap  | sigma/Delta central, "
        "distributed (all sending)"
    )
    rng = np.random.default_rng(1)
    for epsilon in EPSILONS:
        noise = distributed_noise(epsilon, rounds, n, dimension, clip)
        curator = central_sum(epsilon, rounds, clip, rng)
        central = [auc(train(sites, rounds, rate, curator, clip), test) for _ in range(repeats)]
        shares = distributed_sum(noise, clip)
        spread = [auc(train(sites, rounds, rate, shares, clip), test) for _ in range(repeats)]
        central_ratio = curator.sigma / hlr.dp_sensitivity(clip)  # type: ignore[attr-defined]
        sent = noise.share_sigma * math.sqrt(n) / noise.sensitivity
        gap = statistics.mean(central) - statistics.mean(spread)
        print(f"  {epsilon:7g} | {statistics.mean(central):.4f} ({statistics.stdev(central):.4f})"
              f"  | {statistics.mean(spread):.4f} ({statistics.stdev(spread):.4f})     "
              f"| {gap:+.4f} | {central_ratio:.1f}, {sent:.1f}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Cost of a round at ten sites

CLIP_COST = 3.0


def round_cost(sites: list[Site], rounds: int, dp: bool) -> tuple[float, float]:
    """Median seconds of a whole simulated round (every site's update, encoding, masking and
    answer; the coordinator's unmasking) and of one site's update and encoding alone."""
    n, dimension = len(sites), sites[0][0].shape[1] + 3
    names = tuple(f"site_{i}" for i in range(n))
    job = start_job(
        mr.new_job(f"bench-dp-{dp}", names, dimension, min_senders=default_threshold(n))
    )
    noise = distributed_noise(1.0, rounds, n, dimension, CLIP_COST)
    weights = np.full(dimension - 2, 0.01)
    whole, local = [], []
    for round_ in range(rounds):
        started = time.perf_counter()
        ring = {}
        for name, (X, y) in zip(names, sites, strict=True):
            begun = time.perf_counter()
            if dp:
                vector = hlr.clipped_contribution(weights, X, y, CLIP_COST)
                ring[name] = hlr.noisy_ring_input(vector, noise, n, DEFAULT_SCALE_BITS, CLIP_COST)
            else:
                ring[name] = encode(hlr.local_gradient(weights, X, y, L2).packed(), n)
            local.append(time.perf_counter() - begun)
        run_round(job, round_, ring)
        whole.append(time.perf_counter() - started)
    return statistics.median(whole), statistics.median(local)


def flow_round(folder: Path, rounds: int, api: str, count: int, dp: bool, run: str) -> float:
    """Median seconds of a round of the party-mode flow at ``count`` hospital processes."""
    from demo.orgs import make_orgs, serve_all, start
    from storage.descriptor import TableRef
    from storage.ledger import PrivacyLedger
    from storage.party_store import PartyStore

    names = [f"hospital_{i:02d}" for i in range(count)]
    orgs = make_orgs(folder, ["coordinator", *names], receive_timeout=600)
    pooled = pd.concat(
        [pd.read_csv(ROOT / "demo" / "horizontal" / f"hospital_{x}.csv") for x in "abc"],
        ignore_index=True,
    )
    common = ["--job", f"bench-dp-{count}-{dp}-{run}", "--parties", ",".join(names),
              "--rounds", str(rounds), "--learning-rate", "1.0", "--l2", str(L2),
              "--threshold", str(default_threshold(count)),
              "--preprocessing", json.dumps({"scaling": "none"})]  # fmt: skip
    if dp:
        common += ["--dp-epsilon", "4", "--dp-clip-norm", "1"]
    extra = {"PREFECT_API_URL": api}
    servers = serve_all(orgs.values(), extra)
    quiet = {"stderr": subprocess.DEVNULL}  # their logs; a failure names the party below
    coordinator = [*common, "--tol", "0"]
    runs = {"coordinator": start(orgs["coordinator"], "horizontal", coordinator, extra, **quiet)}
    try:
        for i, name in enumerate(names):
            (folder / "tables").mkdir(exist_ok=True)
            ref = TableRef(database=str(folder / "tables" / f"{name}.duckdb"), table="patients",
                           party=name, id_column="patient_id", label_column="diagnosis",
                           label_domain=(0, 1))  # fmt: skip
            PartyStore.of(ref).write_table(ref.table, pooled.iloc[i::count])
            PrivacyLedger(PartyStore.of(ref)).set_budget("patients", 10.0, 1e-5)
            args = [*common, "--table", json.dumps(ref.to_dict())]
            runs[name] = start(orgs[name], "horizontal", args, extra, **quiet)
        out, _ = runs["coordinator"].communicate(timeout=1800)
        if runs["coordinator"].returncode:
            raise SystemExit(f"the coordinator failed (exit {runs['coordinator'].returncode})")
        for name in names:
            runs[name].communicate(timeout=600)
            if runs[name].returncode:
                raise SystemExit(f"{name} failed (exit {runs[name].returncode})")
    finally:
        for process in [*runs.values(), *servers]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
    starts = [e["started_at"] for e in json.loads(out.strip().splitlines()[-1])["history"]]
    return statistics.median(b - a for a, b in itertools.pairwise(starts))


def flow_rounds(rounds: int, repeats: int, count: int = 10) -> None:
    """Runs without and with DP in turn (the machine's load drifts), ``repeats`` of each."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    print(f"\nthe party-mode flow at {count} hospital processes (mTLS on loopback), median "
          f"round of {rounds}, runs alternating:")  # fmt: skip
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=300):
        api = str(PREFECT_API_URL.value())
        for run, dp in itertools.product(range(repeats), (False, True)):
            folder = Path(tmp) / f"{run}-{dp}"
            times[dp].append(flow_round(folder, rounds, api, count, dp, f"{run}"))
    plain, noisy = statistics.median(times[False]), statistics.median(times[True])
    shown = {dp: ", ".join(f"{t:.3f}" for t in found) for dp, found in times.items()}
    print(f"  without DP: {shown[False]} s; with DP (epsilon 4): {shown[True]} s")
    print(f"  medians {plain:.3f} s and {noisy:.3f} s: with / without {noisy / plain:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="noise draws per cell")
    parser.add_argument("--cost-rounds", type=int, default=30, help="rounds timed per setting")
    parser.add_argument("--flow-rounds", type=int, default=10, help="party-mode flow rounds")
    parser.add_argument("--flow-repeats", type=int, default=2, help="flow runs of each kind")
    args = parser.parse_args()
    started = time.perf_counter()
    demo_train, demo_test = demo_sites()
    # settings tuned once without noise in mind: the demo's 30 standardised columns clip at 1,
    # default_credit's 23 at 3; the same for all three ways of training
    accuracy_table("demo hospitals", demo_train, demo_test, 10, 1.0, 1.0, args.repeats)
    credit_train, credit_test = credit_sites()
    accuracy_table("FATE default_credit (homo, 10 sites)", credit_train, credit_test,
                   20, 2.0, 3.0, args.repeats)  # fmt: skip
    print("\ncost of a round at 10 sites (default_credit, 2,400 rows each, dimension 26), "
          f"medians of {args.cost_rounds} rounds:")  # fmt: skip
    plain = round_cost(credit_train, args.cost_rounds, dp=False)
    noisy = round_cost(credit_train, args.cost_rounds, dp=True)
    print("  setting     | whole round (ms) | one site's update + encoding (ms)")
    print(f"  without DP  | {plain[0] * 1e3:16.2f} | {plain[1] * 1e3:.3f}")
    print(f"  with DP     | {noisy[0] * 1e3:16.2f} | {noisy[1] * 1e3:.3f}")
    print(f"  with / without: {noisy[0] / plain[0]:.3f} (whole round)")
    if args.flow_rounds:
        flow_rounds(args.flow_rounds, args.flow_repeats)
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
