"""Operating privreg against a real Prefect server: deployments, schedules, retries, kills.

These start ``prefect server start`` on a free loopback port (once per module) and drive it
with the same commands a user types.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pandas as pd
import pytest

from storage.checkpoints import RoundCheckpoints
from storage.descriptor import TableRef
from storage.party_store import PartyStore

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "fate"
PREFECT = str(Path(sys.executable).parent / "prefect")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
    }
    process = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{env['PREFECT_API_URL']}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    else:
        process.kill()
        pytest.fail("prefect server did not start")
    yield env
    process.terminate()
    process.wait(timeout=30)


def api(env: dict[str, str], path: str, body: dict | None = None) -> object:
    response = httpx.post(f"{env['PREFECT_API_URL']}{path}", json=body or {}, timeout=30)
    response.raise_for_status()
    return response.json()


def test_deployments_from_prefect_yaml_get_scheduled_runs(server: dict[str, str]) -> None:
    subprocess.run(
        [PREFECT, "work-pool", "create", "privreg-process", "--type", "process"],
        env=server,
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [PREFECT, "deploy", "--all", "--no-prompt"],
        env=server,
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    deployments = {d["name"]: d for d in api(server, "/deployments/filter")}
    assert {
        "demo-pipeline",
        "demo-psi",
        "demo-vertical",
        "demo-horizontal",
        "demo-label-dp",
    } <= set(deployments)
    assert deployments["demo-pipeline"]["parameters"] == {"job_file": "jobs/demo.json"}
    deadline = time.monotonic() + 60
    scheduled: list = []
    while time.monotonic() < deadline and not scheduled:
        scheduled = api(
            server,
            "/flow_runs/filter",
            {
                "deployments": {"id": {"any_": [deployments["demo-pipeline"]["id"]]}},
                "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
            },
        )
        time.sleep(1)
    assert scheduled, "the active nightly schedule produced no scheduled run"
    inactive = api(
        server,
        "/flow_runs/filter",
        {"deployments": {"id": {"any_": [deployments["demo-vertical"]["id"]]}}},
    )
    assert inactive == []  # its schedule is inactive


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


def _run_vertical(
    env: dict[str, str],
    workspace: Path,
    guest: dict,
    host: dict,
    extra: str = "",
    wait: bool = True,
) -> subprocess.Popen | subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import json
        from flows.vertical_lr import vertical_lr
        result = vertical_lr({guest!r}, [{host!r}], epochs=3, batch_size=90, seed=1,
                             key_size=1024, allow_insecure_key_size=True, tol=0.0,
                             workspace={str(workspace)!r}, job_id="ops-job"{extra})
        print("RESULT", json.dumps({{"resumed_from": result["resumed_from"],
              "rounds_run": result["rounds_run"], "intercept": result["intercept"]}}))
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


def test_flow_run_retry_resumes_from_the_finished_rounds(
    server: dict[str, str], tmp_path: Path
) -> None:
    guest, host = _breast_job(tmp_path)
    failed = _run_vertical(server, tmp_path, guest, host, extra=", fail_at_round=4")
    assert failed.returncode != 0
    runs = api(
        server,
        "/flow_runs/filter",
        {"flow_runs": {"state": {"type": {"any_": ["FAILED"]}}}, "sort": "START_TIME_DESC"},
    )
    run_id = runs[0]["id"]
    retried = subprocess.run(
        [PREFECT, "flow-run", "retry", run_id, "--entrypoint", "flows/vertical_lr.py:vertical_lr"],
        env=server,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert retried.returncode == 0, retried.stdout + retried.stderr
    state = httpx.get(f"{server['PREFECT_API_URL']}/flow_runs/{run_id}").json()["state"]["type"]
    assert state == "COMPLETED"
    task_runs = api(server, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    completed_rounds = [
        t["name"]
        for t in task_runs
        if t["name"].startswith("round ") and t["state"]["type"] == "COMPLETED"
    ]
    rounds = sorted(int(name.split()[1]) for name in completed_rounds)
    assert rounds == list(range(len(rounds)))  # every round finished exactly once: 0-3 reused
    assert len(rounds) == 3 * 4  # 360 training rows / 90 per batch = 4 batches, 3 epochs


def test_a_killed_run_resumes_and_matches_an_uninterrupted_one(
    server: dict[str, str], tmp_path: Path
) -> None:
    guest, host = _breast_job(tmp_path / "killed")
    guest_ref = TableRef.from_dict(guest)
    process = _run_vertical(server, tmp_path / "killed", guest, host, wait=False)
    # watch the run's channel folder (the party databases are locked by the running process)
    messages = tmp_path / "killed" / "runs" / "ops-job" / "messages"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list(messages.glob("r000003/*")):
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = RoundCheckpoints(PartyStore.of(guest_ref), "vertical", "ops-job").last_round()
    assert 1 <= killed_at < 11
    resumed = _run_vertical(server, tmp_path / "killed", guest, host)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    outcome = _result(resumed.stdout)
    assert outcome["resumed_from"] >= killed_at - 1
    assert outcome["rounds_run"] == 12 - 1 - outcome["resumed_from"]
    guest2, host2 = _breast_job(tmp_path / "straight")
    straight = _result(_run_vertical(server, tmp_path / "straight", guest2, host2).stdout)
    assert straight["rounds_run"] == 12
    assert outcome["intercept"] == straight["intercept"]  # bit-identical model


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
        env=server,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# privreg pipeline: demo" in done.stdout
    assert "470 shared rows of 520 / 519" in done.stdout
