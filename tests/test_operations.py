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
import yaml

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
        # lean polling, so runs and schedules are picked up within seconds
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
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


def api(env: dict[str, str], path: str, body: dict | list | None = None) -> object:
    for attempt in range(5):  # a busy server answers 503 now and then
        response = httpx.post(f"{env['PREFECT_API_URL']}{path}", json=body or {}, timeout=60)
        if response.status_code != 503:
            break
        time.sleep(2 * (attempt + 1))
    response.raise_for_status()
    return response.json()


def test_deployments_from_prefect_yaml_get_scheduled_runs(server: dict[str, str]) -> None:
    subprocess.run(
        [PREFECT, "work-pool", "create", "privreg-process", "--type", "process", "--overwrite"],
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
              "rounds_run": result["rounds_run"], "intercept": result["intercept"],
              "metrics": result["metrics"], "losses": result["losses"]}}))
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
    # the rounds table covers the rounds finished before the retry too, read from the stores
    # an explicit job id (not a derived hash) stays in the key
    table = json.loads(_artifact(server, "patients-vertical-ops-job-rounds")["data"])
    assert [row["round"] for row in table] == list(range(12))
    assert all(row["gradient_norm"] > 0 and row["bytes"] > 0 for row in table)
    summary = _artifact(server, "patients-vertical-summary")
    assert summary["flow_run_id"] == run_id and "| rounds | 12 |" in summary["data"]


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
    # the summary read back through the API holds the figures the flow returned
    summary = _artifact(server, "patients-vertical-summary")["data"]
    auc, log_loss = straight["metrics"]["holdout_auc"], straight["metrics"]["holdout_log_loss"]
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
        env=server,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# privreg pipeline: demo" in done.stdout
    assert "470 shared rows of 520 / 519" in done.stdout


# ---------------------------------------------------------------------------------------------
# Every deployment of prefect.yaml, through a process worker and through serve()

#: Small knobs so every deployment runs in seconds (the demo's own values otherwise).
SMALL = {
    "demo-vertical": {"epochs": 1, "key_size": 1024, "allow_insecure_key_size": True},
    "demo-walr": {"key_size": 1024, "allow_insecure_key_size": True},
    "demo-horizontal": {"rounds": 1},
}
#: Worker deployments run first (the pipeline loads and aligns every table the others use).
ORDER = [
    "demo-pipeline",
    "demo-psi",
    "demo-vertical",
    "demo-walr",
    "demo-label-dp",
    "demo-horizontal",
    "demo-sparse-lda",
    "demo-score-vertical",
    "demo-score-horizontal",
]


def _relocated(value: object, parties: Path) -> object:
    """The deployment's parameters with var/parties/ replaced by a test folder."""
    if isinstance(value, str):
        return value.replace("var/parties", str(parties))
    if isinstance(value, dict):
        return {k: _relocated(v, parties) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocated(v, parties) for v in value]
    return value


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo job and its sub-jobs, pointed at a test folder, with small parameters."""
    root = tmp_path_factory.mktemp("demo")
    parties = root / "parties"
    parties.mkdir()

    def move(job: dict) -> dict:
        for party in job["parties"].values():
            party["source"] = str(ROOT / party["source"])
        return _relocated(job, parties)

    job = move(json.loads((ROOT / "jobs" / "demo.json").read_text()))
    job["vertical"].update(SMALL["demo-vertical"])
    job["walr"].update(SMALL["demo-walr"])
    for name, file in job["subjobs"].items():
        sub = move(json.loads((ROOT / file).read_text()))
        if name == "horizontal_lr":
            sub["horizontal_lr"]["rounds"] = 1
        (root / f"{name}.json").write_text(json.dumps(sub))
        job["subjobs"][name] = str(root / f"{name}.json")
    (root / "demo.json").write_text(json.dumps(job))
    return root


def _parameters(entry: dict, demo_root: Path) -> dict:
    if entry["name"] == "demo-pipeline":
        return {"job_file": str(demo_root / "demo.json"), "workspace": str(demo_root)}
    parameters = {
        **_relocated(entry.get("parameters", {}), demo_root / "parties"),
        **SMALL.get(entry["name"], {}),
    }
    if entry["name"] != "demo-score-horizontal":  # a party's local step: no run messages
        parameters["workspace"] = str(demo_root)
    return parameters


def _wait(env: dict[str, str], run_id: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = httpx.get(f"{env['PREFECT_API_URL']}/flow_runs/{run_id}", timeout=30).json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(1)
    pytest.fail(f"flow run {run_id} did not finish within {timeout} s")


def _run_all(
    env: dict[str, str], demo_root: Path, suffix: str = "", names: list[str] = ORDER
) -> dict[str, dict]:
    """Runs deployments of prefect.yaml (named with ``suffix``) one after the other."""
    spec = {
        d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }
    assert sorted(spec) == sorted(ORDER)
    deployments = {d["name"]: d for d in api(env, "/deployments/filter")}
    finished = {}
    for name in names:
        deployment = deployments[name + suffix]
        run = api(
            env,
            f"/deployments/{deployment['id']}/create_flow_run",
            {"parameters": _parameters(spec[name], demo_root)},
        )
        finished[name] = _wait(env, run["id"])
        assert finished[name]["state"]["type"] == "COMPLETED", (
            name + suffix,
            finished[name]["state"],
        )
    return finished


def _artifact(env: dict[str, str], key: str) -> dict:
    found = api(env, "/artifacts/latest/filter", {"artifacts": {"key": {"any_": [key]}}})
    assert found, f"no artifact {key}"
    return found[0]


def _background(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_every_deployment_runs_on_a_process_worker(
    server: dict[str, str], demo: Path, tmp_path: Path
) -> None:
    """make deploy + make worker: every deployment completes, a schedule fires and runs, each
    run publishes its readable summary, and every parameter has a description in the UI."""
    for command in (
        ["work-pool", "create", "privreg-process", "--type", "process", "--overwrite"],
        ["deploy", "--all", "--no-prompt"],
    ):
        done = subprocess.run(
            [PREFECT, *command], env=server, cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    deployments = api(server, "/deployments/filter")
    for deployment in deployments:
        schema = deployment["parameter_openapi_schema"]["properties"]
        undocumented = [p for p, s in schema.items() if not s.get("description")]
        assert not undocumented, (deployment["name"], undocumented)
        assert deployment["pull_steps"][0]["prefect.deployments.steps.set_working_directory"][
            "directory"
        ] == str(ROOT)  # recorded at deploy time, not left for the worker

    worker = _background(
        [PREFECT, "worker", "start", "--pool", "privreg-process"], server, tmp_path / "worker.log"
    )
    try:
        runs = _run_all(server, demo)
        # a schedule: every hour from a few seconds from now, with the test's parameters
        psi = next(d for d in deployments if d["name"] == "demo-psi")
        entry = {"name": "demo-psi", "parameters": psi["parameters"]}
        anchor = time.time() + 8
        api(
            server,
            f"/deployments/{psi['id']}/schedules",
            [
                {
                    "schedule": {
                        "interval": 3600,
                        "anchor_date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(anchor)),
                        "timezone": "UTC",
                    },
                    "active": True,
                    "parameters": _parameters(entry, demo),
                }
            ],
        )
        scheduled: list = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not scheduled:
            listed = api(
                server, "/flow_runs/filter", {"deployments": {"id": {"any_": [psi["id"]]}}}
            )
            # the schedule also books the next hours' runs: wait for the earliest one
            scheduled = sorted(
                (r for r in listed if r["auto_scheduled"]), key=lambda r: r["expected_start_time"]
            )
            time.sleep(1)
        assert scheduled, "the schedule created no run"
        fired = _wait(server, scheduled[0]["id"])
        assert fired["state"]["type"] == "COMPLETED"
    finally:
        _stop(worker)

    # readable names, and one summary per run with the figures of item 2
    assert runs["demo-vertical"]["name"].startswith("demo vertical: clinic.patients_aligned")
    psi_summary = _artifact(server, "demo-psi-summary")
    assert "| shared rows | 470 |" in psi_summary["data"]
    for name in ("vertical", "walr", "label-dp", "horizontal", "sparse-lda", "pipeline",
                 "score-vertical", "score-local"):  # fmt: skip
        data = _artifact(server, f"demo-{name}-summary")["data"]
        assert "## Parties" in data and "bytes sent" in data and "wall time" in data, name
        if name != "pipeline":
            assert "## Quality" in data and "baseline" in data, name
    for name in ("walr", "label-dp", "sparse-lda"):
        data = _artifact(server, f"demo-{name}-summary")["data"]
        assert "epsilon spent" in data and "delta left" in data, name
    vertical = _artifact(server, "demo-vertical-summary")["data"]
    assert "| AUC |" in vertical and "| log-loss |" in vertical


def test_served_deployments_run_beside_the_deployed_ones(
    server: dict[str, str], demo: Path, tmp_path: Path
) -> None:
    """make serve after make deploy on one server: the served deployments get their own names,
    run from this checkout, and leave the worker's deployments as they were."""
    before = {d["name"]: d for d in api(server, "/deployments/filter")}
    assert "demo-psi" in before  # deployed by the worker test above
    served = _background([sys.executable, "-m", "flows.serve"], server, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 180
        names: set[str] = set()
        while time.monotonic() < deadline and not {f"{n}-served" for n in ORDER} <= names:
            time.sleep(2)
            names = {d["name"] for d in api(server, "/deployments/filter")}
        assert {f"{n}-served" for n in ORDER} <= names, (tmp_path / "serve.log").read_text()
        # the data the worker test loaded; these two re-use its alignment and model
        runs = _run_all(server, demo, "-served", ["demo-psi", "demo-vertical"])
    finally:
        _stop(served)
    assert all(r["state"]["type"] == "COMPLETED" for r in runs.values())
    after = {d["name"]: d for d in api(server, "/deployments/filter")}
    for name in ORDER:  # untouched: still the worker's, with their pull steps
        assert after[name]["work_pool_name"] == "privreg-process"
        assert after[name]["pull_steps"] == before[name]["pull_steps"]
