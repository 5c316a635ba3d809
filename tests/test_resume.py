"""Resuming privreg runs against a real Prefect server: a flow run retried with
``prefect flow-run retry``, a SIGKILLed run restarted, and the demo command."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from helpers import vertical_slices as _slices
from prefect_api import PREFECT, ROOT, api, api_get, prefect_server_process
from prefect_api import artifact as _artifact

from flows.vertical_lr import FAULT_VARIABLE
from storage.checkpoints import RoundCheckpoints
from storage.descriptor import TableRef
from storage.party_store import PartyStore

DATA = ROOT / "benchmarks" / "data" / "fate"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from prefect_server_process(tmp_path_factory.mktemp("prefect-home"))


def _breast_job(workspace: Path) -> tuple[dict, dict]:
    guest = pd.read_csv(DATA / "breast_hetero_guest.csv.gz").head(400)
    host = pd.read_csv(DATA / "breast_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    guest_ref = TableRef(
        database=str(workspace / "guest.duckdb"),
        table="patients",
        label_column="y",
        label_domain=(0, 1),
    )
    host_ref = TableRef(database=str(workspace / "host.duckdb"), table="labs")
    PartyStore.of(guest_ref).import_frame(guest, guest_ref)
    PartyStore.of(host_ref).import_frame(host.reset_index(), host_ref)
    return guest_ref.to_dict(), host_ref.to_dict()


EPOCHS = 2
ROUNDS = EPOCHS * 4  # 360 training rows / 90 per batch = 4 batches per epoch


def _run_vertical(
    env: dict[str, str],
    workspace: Path,
    guest: dict,
    host: dict,
    wait: bool = True,
) -> subprocess.Popen | subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import json
        from flows.vertical_lr import vertical_lr
        result = vertical_lr({guest!r}, [{host!r}], epochs={EPOCHS}, batch_size=90, seed=1,
                             key_size=1024, tol=0.0,
                             workspace={str(workspace)!r}, job_id="ops-job")
        print("RESULT", json.dumps({{"resumed_from": result["resumed_from"],
              "rounds_run": result["rounds_run"], "metrics": result["metrics"]}}))
    """)
    command = [sys.executable, "-c", script]
    if wait:
        return subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
        )
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _result(output: str) -> dict:
    line = [row for row in output.splitlines() if row.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def uninterrupted(
    server: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[float]]:
    """The model slices of the ops job run once without a fault: what an interrupted run
    must end with, bit for bit."""
    workspace = tmp_path_factory.mktemp("straight")
    guest, host = _breast_job(workspace)
    done = _run_vertical(server, workspace, guest, host)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _result(done.stdout)["rounds_run"] == ROUNDS
    return _slices("ops-job", guest, host)


def test_flow_run_retry_resumes_from_the_finished_rounds(
    server: dict[str, str], tmp_path: Path, uninterrupted: dict[str, list[float]]
) -> None:
    guest, host = _breast_job(tmp_path)
    faulty = {**server, FAULT_VARIABLE: "ops-job:4"}  # the tests-only switch, this process only
    failed = _run_vertical(faulty, tmp_path, guest, host)
    assert failed.returncode != 0
    failed_runs = {"state": {"type": {"any_": ["FAILED"]}}}
    runs = api(
        server,
        "/flow_runs/filter",
        {"flow_runs": failed_runs, "flows": {"name": {"any_": ["vertical_lr"]}},
         "sort": "START_TIME_DESC"},
    )  # fmt: skip
    run_id = runs[0]["id"]  # the local run: every party's side is a child run of it
    retried = subprocess.run(
        [PREFECT, "flow-run", "retry", run_id, "--entrypoint", "flows/vertical_lr.py:vertical_lr"],
        env=server,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert retried.returncode == 0, retried.stdout + retried.stderr
    state = api_get(server, f"/flow_runs/{run_id}")["state"]["type"]
    assert state == "COMPLETED"
    children = api(
        server, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}}
    )  # the first try's sides and the retry's
    sides = [child["id"] for child in children]
    assert len(sides) == 6  # guest, host and arbiter, twice
    task_runs = api(server, "/task_runs/filter", {"flow_runs": {"id": {"any_": sides}}})
    completed_rounds = [  # the guest's rounds (the host's and the arbiter's are named alike)
        t["name"]
        for t in task_runs
        if t["name"].startswith("round ")
        and t["name"].endswith(": guest")
        and t["state"]["type"] == "COMPLETED"
    ]
    rounds = sorted(int(name.split()[1].rstrip(":")) for name in completed_rounds)
    # every round finished once, 0-3 in the first try; the retry's guest resumed after round 3,
    # an epoch's last, and redid that epoch's end first (idempotent: its messages stand)
    assert rounds == sorted([*range(ROUNDS), 3])
    assert _slices("ops-job", guest, host) == uninterrupted  # bit-identical model
    # the rounds table covers the rounds finished before the retry too, read from the stores
    # an explicit job id (not a derived hash) stays in the key
    table = json.loads(_artifact(server, "patients-vertical-ops-job-rounds")["data"])
    assert [row["round"] for row in table] == list(range(ROUNDS))
    assert all(row["gradient_norm"] > 0 and row["KiB sent"] > 0 for row in table)
    # which attempt ran each round: the first try ran 0-3, the retry the rest, reusing 0-3
    assert {row["round"] for row in table if row["reused"]} == set(range(4))
    assert len({row["attempt"] for row in table}) == 2
    summary = _artifact(server, "patients-vertical-ops-job-summary")
    assert summary["flow_run_id"] in sides and f"| rounds | {ROUNDS} |" in summary["data"]


def test_a_killed_run_resumes_and_matches_an_uninterrupted_one(
    server: dict[str, str], tmp_path: Path, uninterrupted: dict[str, list[float]]
) -> None:
    guest, host = _breast_job(tmp_path)
    guest_ref = TableRef.from_dict(guest)
    process = _run_vertical(server, tmp_path, guest, host, wait=False)
    # watch the run's channel folder (the party databases are locked by the running process)
    messages = tmp_path / "runs" / "ops-job" / "messages"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list(messages.glob("r000003/*")):
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = RoundCheckpoints(PartyStore.of(guest_ref), "vertical", "ops-job").last_round()
    assert 1 <= killed_at < ROUNDS - 1
    resumed = _run_vertical(server, tmp_path, guest, host)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    outcome = _result(resumed.stdout)
    assert outcome["resumed_from"] >= killed_at - 1
    assert outcome["rounds_run"] == ROUNDS - 1 - outcome["resumed_from"]
    assert _slices("ops-job", guest, host) == uninterrupted  # bit-identical model
    # the summary read back through the API holds the figures the flow returned
    summary = _artifact(server, "patients-vertical-ops-job-summary")["data"]
    auc, log_loss = outcome["metrics"]["holdout_auc"], outcome["metrics"]["holdout_log_loss"]
    assert f"| AUC | {float(f'{auc:.6g}')} | 0.5 | held-out rows | higher |" in summary
    assert f"| log-loss | {float(f'{log_loss:.6g}')} |" in summary
    assert "| guest | 400 |" in summary  # rows used by the guest


def test_the_demo_command_runs_the_pipeline(server: dict[str, str], tmp_path: Path) -> None:
    """``make demo`` runs ``python -m flows.pipeline``: it must run a job and print its summary."""
    job = json.loads((ROOT / "jobs" / "demo.json").read_text())
    for key in ("vertical", "walr", "subjobs"):
        job.pop(key)
    for party in job["parties"].values():
        party["source"] = str(ROOT / party["source"])
        party["table"]["database"] = str(tmp_path / Path(party["table"]["database"]).name)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    done = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", str(job_file)],
        env={**server, "PRIVREG_HOME": str(tmp_path)},  # its runs' messages: not the checkout's
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# privreg pipeline: demo" in done.stdout
    assert "470 shared rows of 520 / 519" in done.stdout
