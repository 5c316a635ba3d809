"""Seconds per round of the horizontal flow: one process, and each party its own process.

Why a module of its own: ``bench_horizontal`` measures the maths; this runs the real flows
(Prefect task runs, DuckDB stores, the channel) on the demo's three hospitals (Wisconsin
breast rows, 31 numbers per model) so the per-round overhead shows beside the protocol's cost.
Party mode starts the coordinator and the hospitals as ``privreg party horizontal`` processes
with their message endpoints (``privreg party serve``) over mutual TLS on loopback.
"""

from __future__ import annotations

import itertools
import json
import resource
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pandas as pd

from demo.orgs import make_orgs, serve_all, start
from storage.descriptor import TableRef
from storage.party_store import PartyStore

ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
OPTIONS = {"local_epochs": 0, "learning_rate": 0.5, "l2": 0.001}


def hospital_names(count: int) -> tuple[str, ...]:
    return HOSPITALS if count == 3 else tuple(f"hospital_{i:02d}" for i in range(count))


def _tables(folder: Path, count: int = 3) -> dict[str, TableRef]:
    """The demo's three hospitals, or its 569 rows dealt round-robin to ``count`` hospitals."""
    frames = [pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv") for name in HOSPITALS]
    names = hospital_names(count)
    if count != 3:
        pooled = pd.concat(frames, ignore_index=True)
        frames = [pooled.iloc[i::count] for i in range(count)]
    refs = {}
    for name, frame in zip(names, frames, strict=True):
        (folder / name).mkdir(parents=True, exist_ok=True)
        ref = TableRef(
            database=str(folder / name / f"{name}.duckdb"),
            table="patients",
            party=name,
            id_column="patient_id",
            label_column="diagnosis",
            label_domain=(0, 1),
        )
        PartyStore.of(ref).write_table(ref.table, frame)
        refs[name] = ref
    return refs


def _per_round(history: list[dict[str, Any]]) -> float:
    """Median seconds from one round's start to the next's: the whole round as the parties
    live it (call, masked inputs, unmasking, model, the parties' checks and saves, the task
    runs in between), start-up excluded."""
    starts = [e["started_at"] for e in history]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    return statistics.median(gaps) if gaps else float("nan")


def one_process(folder: Path, rounds: int) -> dict[str, float]:
    """The one-process flow: median seconds of a round (its secure sum and model update, as
    the rounds table shows) and the flow's wall seconds per round, start-up included."""
    from flows.horizontal_lr import horizontal_lr

    refs = _tables(folder)
    started = time.perf_counter()
    result = horizontal_lr(
        [r.to_dict() for r in refs.values()],
        rounds=rounds,
        tol=0.0,
        threshold=2,
        workspace=str(folder),
        **OPTIONS,
    )
    wall = time.perf_counter() - started
    history = result["history"] if isinstance(result, dict) else result.result()["history"]
    return {"round": _per_round(history), "wall": wall / rounds}


def party_processes(folder: Path, rounds: int, api: str, count: int = 3) -> dict[str, float]:
    """Coordinator and ``count`` hospitals as their own processes over mutual TLS: the
    median round (start to next start), the wall time per round from the coordinator's
    process start to its end, and the CPU seconds per round of all those processes and their
    message endpoints (start-up included: a machine's other load does not show in it)."""
    cpu_before = _children_cpu()
    names = hospital_names(count)
    orgs = make_orgs(folder, ["coordinator", *names], receive_timeout=600)
    refs = _tables(folder / "tables", count)
    extra = {"PREFECT_API_URL": api}
    servers = serve_all(orgs.values(), extra)
    runs: dict[str, subprocess.Popen[str]] = {}
    common = ["--job", f"bench-rounds-{count}", "--parties", ",".join(names)]
    common += ["--learning-rate", "0.5", "--l2", "0.001"]
    common += ["--threshold", str(count // 2 + 1)]  # the agreed terms, at every side
    try:
        started = time.perf_counter()
        coordinator_args = [*common, "--rounds", str(rounds), "--tol", "0"]
        runs["coordinator"] = start(orgs["coordinator"], "horizontal", coordinator_args, extra)
        for name in names:
            args = [*common, "--table", json.dumps(refs[name].to_dict())]
            runs[name] = start(orgs[name], "horizontal", args, extra)
        results: dict[str, Any] = {}
        for name, run in runs.items():
            out, _ = run.communicate(timeout=3600)
            if run.returncode:
                raise SystemExit(f"{name} failed (exit {run.returncode})")
            results[name] = json.loads(out.strip().splitlines()[-1])
            if name == "coordinator":
                wall = time.perf_counter() - started
    finally:
        for process in [*runs.values(), *servers]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
    history = results["coordinator"]["history"]
    cpu = (_children_cpu() - cpu_before) / rounds
    return {"round": _per_round(history), "wall": wall / rounds, "cpu": cpu}


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's ended and waited-for children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fixed_costs(folder: Path, repeats: int = 30) -> dict[str, float]:
    """What one Prefect task run and one opening of a party's DuckDB store cost here (median
    seconds), the two fixed costs every step of a round pays before its own work."""
    from prefect import flow, task

    @task(name="bench-noop")
    def noop(value: int) -> int:
        return value

    @flow(name="bench-task-cost")
    def many(count: int) -> list[float]:
        times = []
        for value in range(count):
            started = time.perf_counter()
            noop(value)
            times.append(time.perf_counter() - started)
        return times

    task_run = statistics.median(many(repeats))
    store = PartyStore(folder / "probe.duckdb")
    openings = []
    for _ in range(repeats):
        started = time.perf_counter()
        with store.transaction() as con:
            con.execute("SELECT 1").fetchone()
        openings.append(time.perf_counter() - started)
    return {"task run": task_run, "store opening": statistics.median(openings)}


def delivery_latency(folder: Path, repeats: int = 20) -> dict[str, float]:
    """Median seconds from a send to the waiting receiver's return, on loopback, for the file
    transport (one folder) and the mTLS gRPC transport (the sender's endpoint serves it)."""
    import threading

    from federation import certs
    from federation.channel import Channel
    from federation.party_config import PartyConfig
    from federation.transport_grpc import GrpcTransport, serve

    def measure(send: Any, receive: Any) -> float:
        lags = []
        for i in range(repeats):
            sent: list[float] = []

            def later(i: int = i, sent: list[float] = sent) -> None:
                time.sleep(0.05)
                sent.append(time.perf_counter())
                send(i)

            thread = threading.Thread(target=later)
            thread.start()
            receive(i)
            lags.append(time.perf_counter() - sent[0])
            thread.join()
        return statistics.median(lags)

    files = Channel(folder / "files", "delivery")
    results = {
        "file": measure(
            lambda i: files.endpoint("bank").send("ads", "probe", [i], round=i),
            lambda i: files.endpoint("ads").receive("bank", "probe", round=i, timeout=30),
        )
    }
    ca = certs.create_ca(folder / "ca")

    def config(name: str, peers: dict[str, int]) -> PartyConfig:
        issued = certs.issue(ca, name, folder / "certs")
        return PartyConfig(
            party=name,
            root=folder / name,
            listen="127.0.0.1:0",
            ca=ca.cert,
            cert=issued.cert,
            key=issued.key,
            peers={p: f"127.0.0.1:{port}" for p, port in peers.items()},
            receive_timeout=30.0,
        )

    bank = config("bank", {})
    server, port = serve(bank)
    try:
        ads = config("ads", {"bank": port})
        sender = Channel(bank.root, "delivery", GrpcTransport(bank)).endpoint("bank")
        receiver = Channel(ads.root, "delivery", GrpcTransport(ads)).endpoint("ads")
        results["mTLS gRPC"] = measure(
            lambda i: sender.send("ads", "probe", [i], round=i),
            lambda i: receiver.receive("bank", "probe", round=i, timeout=30),
        )
    finally:
        server.stop(None)
    return results
