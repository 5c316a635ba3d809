"""Vertical LR: quality beside scikit-learn, and seconds per epoch of the real flow.

Usage: python benchmarks/bench_vertical.py [--fate-rows N] [--fate-keys 1024 2048]
       [--randomizer full|short|standard] [--pool no|ready|both] [--skip-quality]

Quality: train AUC of the protocol's arithmetic (``core.vertical_lr.reference``, which the
tests prove equal to the encrypted protocol bit for bit) against scikit-learn's
LogisticRegression on the joined data, on FATE's breast and default_credit hetero files.

Speed: one epoch of the actual ``vertical_lr`` flow (arbiter, one host, key generation and
the hold-out loss included, wall seconds) on default_credit (30,000 rows, 2048-bit, batch
4,096) and on FATE's benchmark shape (100,000 x (30 guest + 300 host) synthetic rows, 1024-
and 2048-bit keys; FATE reports about 136 s per epoch at 1024 bits on 16 cores per party).
The FATE-shape run is the actual flow on 100,000 rows (about 20 minutes for both key sizes,
with and without a pool, on two cores); ``--fate-rows 20000`` runs fewer rows and scales
linearly to 100,000 (the work is linear in rows, except key generation, which is timed apart
and not scaled, and the run's fixed set-up, which scaling overstates). Each run prints the
split between key generation, encryption, X^T [[d]], decryption, transfer, storage and the
rest (wall seconds), and the CPU seconds of all processes involved: on an idle two-core
machine the epoch takes about max(CPU / 2, the serial part); on a shared one, wall time
inflates.

``--pool ready`` runs the epoch with a job key prepared ahead and each encrypting party's
pool of obfuscators filled before it (as between scheduled runs), and prints that
preparation's wall and CPU seconds on a line of its own; ``both`` (default) runs the epoch
without and with a ready pool, side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import psutil
from prefect import flow
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from core.paillier import cipher
from core.paillier.keys import MIN_SECURE_KEY_BITS, SMALL_KEYS_VARIABLE
from core.paillier.randomness import DEFAULT_RANDOMIZER
from core.vertical_lr.reference import train_reference, with_intercept
from core.vertical_lr.schedule import Schedule
from core.vertical_lr.steps import Optimizer
from federation.channel import Channel, PartyEndpoint
from storage.artifacts import ArtifactStore
from storage.checkpoints import RoundCheckpoints
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import vertical_lr as vertical_steps

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


class Split:
    """Wall seconds per category, measured by wrapping what the flow's tasks call.

    Only the outermost wrapped call on a thread counts, so nothing is counted twice; the
    rest of an epoch ("other") is orchestration and plaintext arithmetic.
    """

    TARGETS: ClassVar[dict[str, list[tuple[object, str]]]] = {
        "key generation": [(vertical_steps, "generate_keypair")],
        "encryption": [(cipher, "encrypt"), (cipher, "rerandomize"), (cipher, "fill_ahead")],
        "X^T [[d]]": [(cipher, "transpose_dot"), (cipher, "weighted_sum")],
        "decryption": [(cipher, "decrypt")],
        "transfer": [(PartyEndpoint, "send"), (PartyEndpoint, "receive")],
        "storage": [
            (ArtifactStore, "put"),
            (ArtifactStore, "get"),
            (ArtifactStore, "delete_prefix"),
            (PartyStore, "read_table"),
            (PartyStore, "_open"),  # a session's opening, outside any other storage call
            (RoundCheckpoints, "save"),
            (RoundCheckpoints, "load"),
        ],
    }

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.TARGETS, 0.0)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Split:
        for category, targets in self.TARGETS.items():
            for owner, name in targets:
                original = getattr(owner, name)
                self._saved.append((owner, name, original))
                setattr(owner, name, self._wrap(category, original))
        return self

    def __exit__(self, *_exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def _wrap(self, category: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if getattr(self._local, "busy", False):
                return function(*args, **kwargs)
            self._local.busy = True
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._local.busy = False
                with self._lock:
                    self.seconds[category] += time.perf_counter() - started

        return timed


def cpu_seconds() -> dict[int, float]:
    """CPU seconds so far of this process and every descendant (pool workers, the local
    Prefect server), so a busy shared machine can be told apart from slow code."""
    me = psutil.Process()
    seconds = {}
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            seconds[process.pid] = times.user + times.system
    return seconds


def cpu_since(before: dict[int, float]) -> float:
    return sum(value - before.get(pid, 0.0) for pid, value in cpu_seconds().items())


def prepare(
    workspace: Path,
    guest_ref: TableRef,
    host_ref: TableRef,
    rows: int,
    key_size: int,
    batch: int,
    randomizer: str,
) -> dict[str, float]:
    """Ahead of the run: the arbiter's key for the job, each encrypting party's full pool."""
    before, started = cpu_seconds(), time.perf_counter()
    job = vertical_steps.keys_job(
        "bench-pooled",
        guest_ref.party,
        (host_ref.party,),
        key_holder_database=str(workspace / "parties" / "arbiter.duckdb"),
        channel=Channel(workspace, "bench-pooled"),
        randomizer=randomizer,
        key_size=key_size,
    )
    vertical_steps.prepare_key(job, key_size)
    keys = time.perf_counter() - started
    job = vertical_steps.agreed_job(job, rows, {}, batch, 0.1)
    values = 0
    for ref in (guest_ref, host_ref):
        values += vertical_steps.prepare_pool(
            job, ref, vertical_steps.obfuscators_needed(job, ref.party)
        )
    wall = time.perf_counter() - started
    return {"wall": wall, "keys": keys, "cpu": cpu_since(before), "values": values}


def flow_epoch(
    guest: pd.DataFrame,
    host: pd.DataFrame,
    key_size: int,
    batch: int,
    randomizer: str,
    options: dict,
    pooled: bool = False,
) -> tuple[float, dict[str, float], dict[str, float] | None]:
    """One epoch of the real ``vertical_lr`` flow (arbiter, one host, key generation and
    hold-out loss included) in a fresh workspace; returns wall seconds, the split and, with
    ``pooled``, the preparation done ahead of the run (key pair and pools)."""
    from flows.vertical_lr import vertical_lr

    with tempfile.TemporaryDirectory() as folder:
        workspace = Path(folder)
        guest_ref = TableRef(
            str(workspace / "guest.duckdb"), "guest", label_column="y", label_domain=(0, 1)
        )
        host_ref = TableRef(str(workspace / "host.duckdb"), "host")
        PartyStore.of(guest_ref).import_frame(guest, guest_ref)
        PartyStore.of(host_ref).import_frame(host, host_ref)
        ahead = None
        if pooled:
            ahead = prepare(workspace, guest_ref, host_ref, len(guest), key_size, batch, randomizer)
            options = {**options, "job_id": "bench-pooled"}
        with Split() as split:
            before = cpu_seconds()
            started = time.perf_counter()
            vertical_lr(
                guest_ref.to_dict(),
                [host_ref.to_dict()],
                epochs=1,
                batch_size=batch,
                key_size=key_size,
                workspace=str(workspace),
                randomizer=randomizer,
                tol=0.0,
                **options,
            )
            seconds = time.perf_counter() - started
            cpu = cpu_since(before)
    return seconds, {**split.seconds, "cpu": cpu}, ahead


def synthetic_fate(rows: int, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """FATE's benchmark shape: 30 guest features + labels, 300 host features, standardised."""
    rng = np.random.default_rng(seed)
    guest_X, host_X = rng.standard_normal((rows, 30)), rng.standard_normal((rows, 300))
    score = guest_X[:, :5].sum(axis=1) + host_X[:, :5].sum(axis=1)
    y = (score + rng.standard_normal(rows) > 0).astype(int)
    guest = pd.DataFrame(guest_X, columns=[f"g{i}" for i in range(30)])
    guest.insert(0, "y", y)
    guest.insert(0, "id", np.arange(rows))
    host = pd.DataFrame(host_X, columns=[f"h{i}" for i in range(300)])
    host.insert(0, "id", np.arange(rows))
    return guest, host


def split_row(label: str, seconds: float, split: dict[str, float], scale: float = 1.0) -> str:
    """Times scaled to the full row count, except key generation (once per job; its CPU
    is in the scaled CPU column, which therefore errs high)."""
    split = dict(split)
    cpu = split.pop("cpu")
    keys = split.pop("key generation")
    other = seconds - keys - sum(split.values())
    total = keys + scale * (seconds - keys)
    cells = " | ".join(f"{scale * v:,.1f}" for v in [*split.values(), other])
    return f"| {label} | {total:,.1f} | {keys:,.1f} | {cells} | {scale * cpu:,.1f} |"


def ahead_line(label: str, ahead: dict[str, float], scale: float = 1.0) -> str:
    wall = ahead["keys"] + scale * (ahead["wall"] - ahead["keys"])
    return (
        f"- {label}: prepared ahead of the run (key pair {ahead['keys']:,.1f} s, not scaled; "
        f"{scale * ahead['values']:,.0f} obfuscators): {wall:,.1f} s wall, "
        f"{scale * ahead['cpu']:,.1f} CPU s"
    )


def runs(pool: str) -> list[bool]:
    return {"no": [False], "ready": [True], "both": [False, True]}[pool]


def credit_epoch(randomizer: str, header: str, rule: str, pool: str) -> None:
    guest = pd.read_csv(DATA / "default_credit_hetero_guest.csv.gz")
    host = pd.read_csv(DATA / "default_credit_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    credit = TRAINING["default_credit"]
    options = {
        "learning_rate": credit["learning_rate"],
        "momentum": credit["momentum"],
        "clip_features": credit["clip"],
    }
    print(
        f"\n### The vertical_lr flow, one epoch: default_credit ({len(guest):,} rows, 13 + 10 "
        f"features), 2048-bit, batch 4,096, arbiter, one host, randomizer {randomizer!r}\n"
    )
    print(header)
    print(rule)
    notes = []
    for pooled in runs(pool):
        seconds, split, ahead = flow_epoch(
            guest, host.reset_index(), 2048, credit["batch_size"], randomizer, options, pooled
        )
        label = "default_credit, pool ready" if pooled else "default_credit, no pool"
        print(split_row(label, seconds, split))
        if ahead is not None:
            notes.append(ahead_line(label, ahead))
    print("\n" + "\n".join(notes) if notes else "")


@flow(name="bench-vertical-warm-up")
def server_warm_up() -> None:
    """Nothing: calling it starts the local Prefect server, a one-off per process that must
    not be timed (nor scaled with rows) as part of an epoch."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--fate-rows",
        type=int,
        default=100_000,
        help="rows of the FATE-shape run (default: the full 100,000; fewer are scaled to it)",
    )
    parser.add_argument("--fate-keys", type=int, nargs="*", default=[1024, 2048])
    parser.add_argument("--randomizer", default=DEFAULT_RANDOMIZER)
    parser.add_argument("--pool", choices=["no", "ready", "both"], default="both")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-credit", action="store_true", help="only the FATE-shape runs")
    args = parser.parse_args()
    if min(args.fate_keys, default=MIN_SECURE_KEY_BITS) < MIN_SECURE_KEY_BITS:
        os.environ[SMALL_KEYS_VARIABLE] = "1"  # FATE's 1024-bit comparison: a benchmark's opt-in

    if not args.skip_quality:
        print("\n### Quality: train AUC, protocol arithmetic vs scikit-learn (joined data)\n")
        print("| data | rows | training | privreg | scikit-learn | difference |")
        print("|---|---|---|---|---|---|")
        print("\n".join(quality_rows()))

    server_warm_up()
    header = (
        "| run | s / epoch | " + " | ".join(Split.TARGETS) + " | other | CPU s, all processes |"
    )
    rule = "|---" * (len(Split.TARGETS) + 4) + "|"
    if not args.skip_credit:
        credit_epoch(args.randomizer, header, rule, args.pool)

    scale = 100_000 / args.fate_rows
    note = "" if args.fate_rows == 100_000 else f", measured on {args.fate_rows:,} rows, x{scale:g}"
    print(
        f"\n### FATE's shape: 100,000 x (30 + 300) synthetic, one epoch, batch 4,096, "
        f"randomizer {args.randomizer!r}{note}\n"
    )
    print(header)
    print(rule)
    fate_guest, fate_host = synthetic_fate(args.fate_rows)
    notes = []
    for key_size in args.fate_keys:
        for pooled in runs(args.pool):
            seconds, split, ahead = flow_epoch(
                fate_guest, fate_host, key_size, 4096, args.randomizer, {}, pooled
            )
            label = f"{key_size}-bit, " + ("pool ready" if pooled else "no pool")
            print(split_row(label, seconds, split, scale))
            if ahead is not None:
                notes.append(ahead_line(label, ahead, scale))
    print("\n" + "\n".join(notes) if notes else "")


if __name__ == "__main__":
    main()
