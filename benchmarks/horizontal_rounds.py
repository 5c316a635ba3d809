"""Seconds per round of the horizontal flow: one process, and each party its own process.

Why a module of its own: ``bench_horizontal`` measures the maths; this runs the real flows
(Prefect task runs, DuckDB stores, the channel) on the demo's three hospitals (Wisconsin
breast rows, 31 numbers per model) so the per-round overhead shows beside the protocol's cost.
Party mode starts the coordinator and the hospitals as ``privreg party horizontal`` processes
with their message endpoints (``privreg party serve``) over mutual TLS on loopback.
"""

from __future__ import annotations

import json
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


def _tables(folder: Path) -> dict[str, TableRef]:
    refs = {}
    for name in HOSPITALS:
        frame = pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")
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
    return {
        "round": statistics.median(e["seconds"] for e in history),
        "wall": wall / rounds,
    }


def party_processes(folder: Path, rounds: int, api: str) -> dict[str, float]:
    """Coordinator and hospitals as their own processes: the same two figures, the wall time
    from the coordinator's process start to its end."""
    orgs = make_orgs(folder, ["coordinator", *HOSPITALS], receive_timeout=600)
    refs = _tables(folder / "tables")
    extra = {"PREFECT_API_URL": api}
    servers = serve_all(orgs.values(), extra)
    runs: dict[str, subprocess.Popen[str]] = {}
    common = ["--job", "bench-rounds", "--parties", ",".join(HOSPITALS)]
    common += ["--learning-rate", "0.5", "--l2", "0.001"]
    try:
        started = time.perf_counter()
        coordinator_args = [*common, "--rounds", str(rounds), "--tol", "0", "--threshold", "2"]
        runs["coordinator"] = start(orgs["coordinator"], "horizontal", coordinator_args, extra)
        for name in HOSPITALS:
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
    return {"round": statistics.median(e["seconds"] for e in history), "wall": wall / rounds}


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
