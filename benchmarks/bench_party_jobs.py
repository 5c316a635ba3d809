"""Vertical LR and sparse LDA with every party its own process: a job's seconds after start-up.

Usage: python benchmarks/bench_party_jobs.py [--only vertical|sparse-lda] [--keep FOLDER]

Why: on small tables a job's time is its fixed costs (key and table set-up, process pools,
storage openings, waits), not its arithmetic. This runs the real party commands (``privreg
party vertical`` and ``privreg party sparse-lda``), each organisation its own process with
its own folder, database and message endpoint (``privreg party serve``) over mutual TLS on
loopback, all against one Prefect API started here, and prints:

* vertical LR on the demo's 470 aligned rows (clinic guest, lab host, arbiter; the demo job's
  options: 4 epochs of one batch, so 4 rounds, each with its hold-out loss; 2048-bit keys):
  the job after start-up (the last party's flow start to the last party's end, from Prefect's
  flow runs), each round (the guest's sends of ``[[d]]``, one round's to the next's, median),
  the cryptography of a round (encryption, re-randomisation, ``X^T [[d]]``, decryption as the
  same job's one-process run spends them, divided by its rounds) and the overhead (round
  minus cryptography; the target is under 0.3 s, the job under 10 s);
* sparse LDA on the demo's three hospitals (the demo job's options: row-level, epsilon 1):
  the coordinator's flow run from start to end, and each party's.

CPU seconds of the party processes stand beside the wall seconds: on a shared machine the
wall inflates, the CPU much less. The total from launch to exit comes from ``RUSAGE_CHILDREN``
(pool workers not counted: they are children of multiprocessing's fork server, and their time
does not reach the party process); the vertical job's table splits the CPU spent within the
job's own span by process, pool workers included (:mod:`benchmarks.process_cpu`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.process_cpu import ProcessCpu
from core.job_files import read_job
from demo.orgs import Org, make_orgs, serve_all, start
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore

ROOT = Path(__file__).resolve().parents[1]
VERTICAL_TARGETS = {"job": 10.0, "overhead": 0.3}
CRYPTO = ("encryption", "X^T [[d]]", "decryption")


def children_cpu() -> float:
    """CPU seconds of this process's waited-for children and their waited-for descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def flow_runs(prefix: str) -> dict[str, tuple[float, float]]:
    """(start, end) in epoch seconds of every finished flow run named ``<prefix>: <party>``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters

    runs = {}
    with get_client(sync_client=True) as client:
        named = filters.FlowRunFilter(name=filters.FlowRunFilterName(like_=f"{prefix}: "))
        for run in client.read_flow_runs(flow_run_filter=named):
            if run.start_time and run.end_time:
                party = run.name.rsplit(": ", 1)[1]
                runs[party] = (run.start_time.timestamp(), run.end_time.timestamp())
    return runs


def run_parties(
    orgs: dict[str, Org], command: str, args: dict[str, list[str]], api: str, sampler: ProcessCpu
) -> tuple[dict[str, Any], float, float]:
    """Every party's endpoint, then ``privreg party <command>`` in each party's process, each
    watched by ``sampler``; returns each party's result, the wall seconds from launch to the
    last exit and the CPU seconds of the party processes (endpoints included)."""
    extra = {"PREFECT_API_URL": api}
    cpu = children_cpu()
    servers = serve_all(orgs.values(), extra)
    for org, server in zip(orgs.values(), servers, strict=True):
        sampler.watch(server.pid, f"{org.party} endpoint")
    runs: dict[str, subprocess.Popen[str]] = {}
    results: dict[str, Any] = {}
    try:
        started = time.perf_counter()
        for party, party_args in args.items():
            with (orgs[party].folder / "stderr.log").open("a") as log:
                runs[party] = start(orgs[party], command, party_args, extra, stderr=log)
            sampler.watch(runs[party].pid, party)
        for party, run in runs.items():
            out, _ = run.communicate(timeout=1800)
            if run.returncode:
                tail = (orgs[party].folder / "stderr.log").read_text()[-3000:]
                raise SystemExit(f"{party} failed (exit {run.returncode}):\n{tail}")
            results[party] = json.loads(out.strip().splitlines()[-1])
        wall = time.perf_counter() - started
    finally:
        for process in [*runs.values(), *servers]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
    return results, wall, children_cpu() - cpu


# ---- vertical LR --------------------------------------------------------------------------
def vertical_options() -> dict[str, Any]:
    """The demo job's vertical options (2048-bit keys, the default), every round run."""
    return {**read_job(ROOT / "jobs" / "demo.json")["vertical"], "tol": 0.0}


def vertical_tables(folder: Path) -> dict[str, TableRef]:
    """The demo's clinic and lab rows on their common patients, in the same order (what PSI
    leaves as the *_aligned tables), each in its owner's own database under ``folder``."""
    guest = pd.read_csv(ROOT / "demo" / "clinic_guest.csv").set_index("patient_id")
    host = pd.read_csv(ROOT / "demo" / "lab_host.csv").set_index("patient_id")
    common = sorted(set(guest.index) & set(host.index))
    refs = {
        "clinic": TableRef(
            str(folder / "clinic" / "clinic.duckdb"), "patients_aligned", party="clinic",
            id_column="patient_id", label_column="diagnosis", label_domain=(0, 1),
        ),
        "lab": TableRef(
            str(folder / "lab" / "lab.duckdb"), "measurements_aligned", party="lab",
            id_column="patient_id",
        ),
    }  # fmt: skip
    for name, frame in (("clinic", guest), ("lab", host)):
        PartyStore.of(refs[name]).import_frame(frame.loc[common].reset_index(), refs[name])
    return refs


def vertical_parties(folder: Path, api: str, job: str) -> dict[str, float]:
    """Clinic (guest), lab (host) and arbiter as processes: the job after start-up, the median
    round, the processes' wall and CPU seconds."""
    orgs = make_orgs(folder, ["clinic", "lab", "arbiter"], receive_timeout=600)
    refs = vertical_tables(folder)
    options = json.dumps(vertical_options())
    common = ["--job", job, "--guest", "clinic", "--hosts", "lab", "--options", options]
    args = {
        "arbiter": [*common, "--role", "arbiter"],
        "lab": [*common, "--role", "host", "--table", json.dumps(refs["lab"].to_dict())],
        "clinic": [*common, "--role", "guest", "--table", json.dumps(refs["clinic"].to_dict())],
    }
    with ProcessCpu() as sampler:
        results, wall, cpu = run_parties(orgs, "vertical", args, api, sampler)
    spans = flow_runs(f"vertical_lr {job}")
    job_start, job_end = max(s for s, _ in spans.values()), max(end for _, end in spans.values())
    job_seconds = job_end - job_start
    # round r starts when the guest sends the hosts [[d]] of round r - 1 ... (its last step
    # that waits for nobody but the hosts): one send to the next is one whole round
    sent = sorted(
        f.stat().st_mtime for f in (orgs["clinic"].messages / job).rglob("clinic__lab__residual")
    )
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    rounds = results["clinic"]["rounds_run"]
    return {
        "job": job_seconds,
        "round": statistics.median(gaps) if gaps else float("nan"),
        "rounds": rounds,
        "wall": wall,
        "cpu": cpu,
        "job cpu": sampler.between(job_start, job_end),
        **{f"start-up {p}": s - min(t for t, _ in spans.values()) for p, (s, _) in spans.items()},
    }


def vertical_crypto(folder: Path) -> dict[str, float]:
    """The same job in one process (``vertical_lr``): its cryptography's seconds per round
    (key generation apart), measured by wrapping the cipher calls."""
    from benchmarks.bench_vertical import Split
    from flows.vertical_lr import vertical_lr

    refs = vertical_tables(folder)
    options = vertical_options()
    with Split() as split:
        started = time.perf_counter()
        result = vertical_lr(
            refs["clinic"].to_dict(), [refs["lab"].to_dict()], workspace=str(folder), **options
        )
        wall = time.perf_counter() - started
    rounds = result["rounds_run"]
    crypto = sum(split.seconds[c] for c in CRYPTO)
    return {
        "crypto": crypto / rounds,
        "keys": split.seconds["key generation"],
        **{c: split.seconds[c] / rounds for c in CRYPTO},
        "wall": wall,
        "rounds": rounds,
    }


# ---- sparse LDA ---------------------------------------------------------------------------
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")


def sparse_lda_parties(folder: Path, api: str, job: str) -> dict[str, float]:
    """The demo's three hospitals and the coordinator as processes, the demo job's options."""
    spec = read_job(ROOT / "jobs" / "sparse_lda_demo.json")
    orgs = make_orgs(folder, ["coordinator", *HOSPITALS], receive_timeout=600)
    options = json.dumps(spec["sparse_lda"])
    common = ["--job", job, "--parties", ",".join(HOSPITALS), "--options", options]
    args = {"coordinator": list(common)}
    for name in HOSPITALS:
        entry = spec["parties"][name]
        ref = TableRef.from_dict(
            {**entry["table"], "database": str(orgs[name].folder / f"{name}.duckdb")}
        )
        store = PartyStore.of(ref)
        store.import_frame(pd.read_csv(ROOT / entry["source"]), ref)
        budget = entry["privacy_budget"]  # the owner's grant, as its party.toml would give it
        PrivacyLedger(store).set_budget(ref.table, budget["epsilon"], budget["delta"])
        args[name] = [*common, "--table", json.dumps(ref.to_dict())]
    with ProcessCpu() as sampler:
        _, wall, cpu = run_parties(orgs, "sparse-lda", args, api, sampler)
    spans = flow_runs(f"sparse_lda {job}")
    start, end = spans["coordinator"]
    return {
        "coordinator": end - start,
        "job": max(e for _, e in spans.values()) - max(s for s, _ in spans.values()),
        "wall": wall,
        "cpu": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["vertical", "sparse-lda"])
    parser.add_argument("--keep", help="keep the organisations' folders under this folder")
    args = parser.parse_args()

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    folder = Path(args.keep or tempfile.mkdtemp(prefix="bench-party-jobs-"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    stamp = time.strftime("%H%M%S")
    try:
        with prefect_test_harness(server_startup_timeout=300):
            api = str(PREFECT_API_URL.value())
            if args.only in (None, "vertical"):
                load = os.getloadavg()[0]
                parties = vertical_parties(folder / "vertical", api, f"bench-vertical-{stamp}")
                crypto = vertical_crypto(folder / "vertical-one")
                print_vertical(parties, crypto, load)
            if args.only in (None, "sparse-lda"):
                load = os.getloadavg()[0]
                lda = sparse_lda_parties(folder / "sparse-lda", api, f"bench-lda-{stamp}")
                print_sparse_lda(lda, load)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def print_vertical(parties: dict[str, float], crypto: dict[str, float], load: float) -> None:
    overhead = parties["round"] - crypto["crypto"]
    print(
        f"\n## vertical LR, demo's 470 rows, {parties['rounds']} rounds, guest + host + arbiter "
        f"processes over mTLS (load average {load:.1f})\n"
    )
    rows = [
        ("job after start-up, s", parties["job"], VERTICAL_TARGETS["job"]),
        ("round, s (median)", parties["round"], None),
        ("cryptography per round, s (one-process run)", crypto["crypto"], None),
        ("overhead per round (round - cryptography), s", overhead, VERTICAL_TARGETS["overhead"]),
    ]
    print("| measure | seconds | target (met) |\n|---|---|---|")
    for name, value, target in rows:
        met = "-" if target is None else f"{target} ({'yes' if value <= target else 'no'})"
        print(f"| {name} | {value:.2f} | {met} |")
    split = ", ".join(f"{c} {crypto[c]:.2f}" for c in CRYPTO)
    starts = ", ".join(f"{k.split()[1]} +{v:.1f}" for k, v in parties.items() if "start-up" in k)
    print(
        f"\ncryptography per round: {split}; key generation {crypto['keys']:.2f} s once per job "
        f"(in the job's time). Processes: {parties['wall']:.1f} s wall from launch, "
        f"{parties['cpu']:.1f} CPU s (endpoints included, pool workers not); flow starts after "
        f"the first: {starts}. One-process run: {crypto['wall']:.1f} s."
    )
    job_cpu = parties["job cpu"]
    print("\n| CPU s within the job (after start-up) | seconds |\n|---|---|")
    for label in sorted(job_cpu):
        print(f"| {label} | {job_cpu[label]:.2f} |")
    print(f"| all | {sum(job_cpu.values()):.2f} |")
    print("\n(a party's children are its pool workers and their fork server)")


def print_sparse_lda(lda: dict[str, float], load: float) -> None:
    print(
        f"\n## sparse LDA, demo's 3 hospitals + coordinator processes over mTLS "
        f"(load average {load:.1f})\n"
    )
    print("| measure | seconds |\n|---|---|")
    print(f"| coordinator's flow run | {lda['coordinator']:.2f} |")
    print(f"| job after start-up (last start to last end) | {lda['job']:.2f} |")
    print(f"| processes, launch to last exit | {lda['wall']:.2f} |")
    print(f"| CPU, all party processes | {lda['cpu']:.2f} |")


if __name__ == "__main__":
    main()
