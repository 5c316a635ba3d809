"""Operating privreg against a real Prefect server: deployments from prefect.yaml through a
process worker and through serve(), schedules, summaries, and a retry from the UI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from helpers import vertical_slices as _slices
from prefect_api import PREFECT, ROOT, api, api_get, prefect_server_process
from prefect_api import artifact as _artifact

from flows.vertical_lr import FAULT_VARIABLE
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from prefect_server_process(tmp_path_factory.mktemp("prefect-home"))


@pytest.fixture(scope="module")
def deployed(server: dict[str, str]) -> dict[str, str]:
    """make deploy, once per module: the process work pool and every prefect.yaml deployment."""
    for command in (
        ["work-pool", "create", "privreg-process", "--type", "process", "--overwrite"],
        ["deploy", "--all", "--no-prompt"],
    ):
        done = subprocess.run(
            [PREFECT, *command], env=server, cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return server


def test_deployments_from_prefect_yaml_get_scheduled_runs(deployed: dict[str, str]) -> None:
    server = deployed
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


# ---------------------------------------------------------------------------------------------
# Every deployment of prefect.yaml, through a process worker and through serve()

#: Small knobs so every deployment runs in seconds (the demo's own values otherwise).
SMALL = {
    "demo-vertical": {"epochs": 2, "key_size": 1024},
    "demo-walr": {"key_size": 1024},
    "demo-horizontal": {"rounds": 1},
}
#: The worker's demo-vertical run fails in its second round and is retried like the UI does:
#: the worker's environment has the tests-only fault switch for that job's round 1.
FAULTS = {"demo-vertical": {"job_id": "retried"}}
FAULTY_ROUND = {FAULT_VARIABLE: "retried:1"}
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


#: After the pipeline, the deployments run in two lanes at once: each lane's deployments share
#: parties' databases and run in order; the lanes share none (the clinic, lab and registry's
#: stores against the hospitals').
LANES = [
    ["demo-psi", "demo-vertical", "demo-walr", "demo-label-dp", "demo-score-vertical"],
    ["demo-horizontal", "demo-sparse-lda", "demo-score-horizontal"],
]


#: The served deployments run (all are registered): see the served test's docstring.
SERVED_RUNS = ["demo-psi", "demo-score-horizontal"]


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


def _latest_like(env: dict[str, str], pattern: str) -> dict:
    """The newest artifact whose key matches ``pattern`` (SQL LIKE: keys carry a job id)."""
    found = api(env, "/artifacts/filter", {"artifacts": {"key": {"like_": pattern}},
                                            "sort": "CREATED_DESC", "limit": 1})  # fmt: skip
    assert found, f"no artifact like {pattern}"
    return found[0]


def _last_log_lines(env: dict[str, str], run_id: str, count: int = 15) -> list[str]:
    """A failed run's last log lines (its error), for the assertion message."""
    logs = api(env, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                      "sort": "TIMESTAMP_DESC", "limit": count})  # fmt: skip
    return [entry["message"][-400:] for entry in reversed(logs)]


def _wait(env: dict[str, str], run_id: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = api_get(env, f"/flow_runs/{run_id}")
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(1)
    pytest.fail(f"flow run {run_id} did not finish within {timeout} s")


def _retry_like_the_ui(env: dict[str, str], run_id: str) -> dict:
    """The UI's Retry (and `prefect flow-run retry` for a deployment run): back to Scheduled,
    so a worker picks the same flow run up again."""
    body = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True}
    assert api(env, f"/flow_runs/{run_id}/set_state", body)["status"] == "ACCEPT"
    return _wait(env, run_id)


def _run_all(
    env: dict[str, str],
    demo_root: Path,
    suffix: str = "",
    names: list[str] = ORDER,
    faults: dict[str, dict] | None = None,
) -> dict[str, dict]:
    """Runs deployments of prefect.yaml (named with ``suffix``) one after the other; a run
    given a fault must fail, and then complete once retried."""
    spec = {
        d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }
    assert sorted(spec) == sorted(ORDER)
    deployments = {d["name"]: d for d in api(env, "/deployments/filter")}
    finished = {}
    for name in names:
        deployment = deployments[name + suffix]
        fault = (faults or {}).get(name, {})
        run = api(
            env,
            f"/deployments/{deployment['id']}/create_flow_run",
            {
                "parameters": {**_parameters(spec[name], demo_root), **fault},
                "idempotency_key": f"{name}{suffix}-{time.time_ns()}",
            },
        )
        finished[name] = _wait(env, run["id"])
        if fault:
            assert finished[name]["state"]["type"] == "FAILED", finished[name]["state"]
            finished[name] = _retry_like_the_ui(env, run["id"])
        assert finished[name]["state"]["type"] == "COMPLETED", (
            name + suffix,
            finished[name]["state"],
            _last_log_lines(env, run["id"]),
        )
    return finished


def _run_lanes(
    env: dict[str, str], demo_root: Path, faults: dict[str, dict] | None = None
) -> dict[str, dict]:
    """The pipeline, then :data:`LANES` side by side on the one worker (each lane in order)."""
    assert sorted(ORDER) == sorted([ORDER[0], *(name for lane in LANES for name in lane)])
    finished = _run_all(env, demo_root, names=ORDER[:1], faults=faults)
    with ThreadPoolExecutor(len(LANES)) as pool:
        lanes = [pool.submit(_run_all, env, demo_root, names=lane, faults=faults) for lane in LANES]
        for lane in lanes:
            finished.update(lane.result())
    return finished


def _spends(demo_root: Path) -> list[dict]:
    """Every privacy charge booked in the demo parties' ledgers."""
    return [
        spend
        for database in sorted((demo_root / "parties").glob("*.duckdb"))
        for spend in PrivacyLedger(PartyStore(database)).spends()
    ]


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
    deployed: dict[str, str], demo: Path, tmp_path: Path
) -> None:
    """make deploy + make worker: every deployment completes, a schedule fires and runs, each
    run publishes its readable summary, and every parameter has a description in the UI."""
    server = deployed
    deployments = api(server, "/deployments/filter")
    for deployment in deployments:
        schema = deployment["parameter_openapi_schema"]["properties"]
        undocumented = [p for p, s in schema.items() if not s.get("description")]
        assert not undocumented, (deployment["name"], undocumented)
        assert deployment["pull_steps"][0]["prefect.deployments.steps.set_working_directory"][
            "directory"
        ] == str(ROOT)  # recorded at deploy time, not left for the worker

    worker = _background(
        [PREFECT, "worker", "start", "--pool", "privreg-process"],
        {**server, **FAULTY_ROUND},
        tmp_path / "worker.log",
    )
    try:
        runs = _run_lanes(server, demo, faults=FAULTS)
        # a retry of a finished pipeline reuses every release: no budget is spent twice
        spent = _spends(demo)
        assert spent and all(s["epsilon"] > 0 for s in spent)
        assert _retry_like_the_ui(server, runs["demo-pipeline"]["id"])["state"]["type"] == (
            "COMPLETED"
        )
        assert _spends(demo) == spent
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

    # the retried deployment run resumed after its finished round and ended with the model
    # of the pipeline's uninterrupted run on the same tables and options
    tables = runs["demo-vertical"]["parameters"]
    models = ArtifactStore(PartyStore.of(TableRef.from_dict(tables["guest"]))).list(
        "models/vertical/"
    )
    (pipeline_job,) = {key.split("/")[2] for key, *_ in models} - {"retried"}
    assert _slices("retried", tables["guest"], *tables["hosts"]) == _slices(
        pipeline_job, tables["guest"], *tables["hosts"]
    )
    rounds = json.loads(_artifact(server, "demo-vertical-retried-rounds")["data"])
    assert [row["round"] for row in rounds] == [0, 1]
    assert [bool(row["reused"]) for row in rounds] == [True, False]  # round 0: the first try
    # a run of another job id has its own summary: the pipeline's did not overwrite it
    retried = _artifact(server, "demo-vertical-retried-summary")
    sides = api(  # the deployment's run is a local run: the guest's side publishes it
        server,
        "/flow_runs/filter",
        {"flow_runs": {"parent_flow_run_id": {"any_": [runs["demo-vertical"]["id"]]}}},
    )
    assert retried["flow_run_id"] in {side["id"] for side in sides}
    assert "| held-out rows |" in retried["data"] and " KiB |" in retried["data"]
    # readable names, and one summary per run with the figures of item 2
    assert runs["demo-vertical"]["name"].startswith("demo vertical: clinic.patients_aligned")
    psi_summary = _latest_like(server, "demo-psi-%-summary")
    assert "| shared rows | 470 |" in psi_summary["data"]
    for name in ("vertical", "walr", "label-dp", "horizontal", "sparse-lda", "pipeline",
                 "score-vertical", "score-local"):  # fmt: skip
        data = _latest_like(server, f"demo-{name}-%-summary")["data"]
        assert "## Parties" in data and "bytes sent" in data and "wall time" in data, name
        if name != "pipeline":
            assert "## Quality" in data and "baseline" in data, name
    for name in ("walr", "label-dp", "sparse-lda"):
        data = _latest_like(server, f"demo-{name}-%-summary")["data"]
        assert "epsilon spent" in data and "at the owner's delta" in data, name
    assert "| AUC |" in retried["data"] and "| log-loss |" in retried["data"]
    # scoring used the models the pipeline promoted, and says which rows they trained on
    scored = _latest_like(server, "demo-score-vertical-%-summary")["data"]
    assert (
        f"models/vertical/{pipeline_job}/clinic" in scored
        and "| rows the model held out |" in scored
    )


def test_served_deployments_run_beside_the_deployed_ones(
    deployed: dict[str, str], demo: Path, tmp_path: Path
) -> None:
    """make serve after make deploy on one server: the served deployments get their own names,
    run from this checkout, and leave the worker's deployments as they were.

    Every served deployment is built by the same code from its prefect.yaml entry, whose flow
    and parameters the worker test above runs (the pipeline too, and its retry: releases
    reused, no budget spent twice); two of them run here: PSI (two parties' sides, on the
    worker test's data) and a party's local scoring step, the one deployment that runs
    without a workspace."""
    server = deployed
    before = {d["name"]: d for d in api(server, "/deployments/filter")}
    assert "demo-psi" in before  # deployed by the module's `deployed` fixture
    served = _background([sys.executable, "-m", "flows.serve"], server, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 180
        names: set[str] = set()
        while time.monotonic() < deadline and not {f"{n}-served" for n in ORDER} <= names:
            time.sleep(2)
            names = {d["name"] for d in api(server, "/deployments/filter")}
        assert {f"{n}-served" for n in ORDER} <= names, (tmp_path / "serve.log").read_text()
        # the worker's deployments keep the schedules: their served twins' are inactive
        pipeline = next(
            d for d in api(server, "/deployments/filter") if d["name"] == "demo-pipeline-served"
        )
        assert pipeline["schedules"] and not any(s["active"] for s in pipeline["schedules"])
        # every deployment again, served: on the data the worker test loaded (its stored
        # alignments, models and releases are reused, so no budget is spent twice)
        spent = _spends(demo)
        runs = _run_all(server, demo, "-served", SERVED_RUNS)
    finally:
        _stop(served)
    assert sorted(runs) == sorted(SERVED_RUNS)
    assert all(r["state"]["type"] == "COMPLETED" for r in runs.values())
    log = (tmp_path / "serve.log").read_text()  # run by the serve process, from this checkout
    assert all(f"/flow-run/{r['id']}" in log for r in runs.values()), log[-2000:]
    assert _spends(demo) == spent
    after = {d["name"]: d for d in api(server, "/deployments/filter")}
    for name in ORDER:  # untouched: still the worker's, with their pull steps
        assert after[name]["work_pool_name"] == "privreg-process"
        assert after[name]["pull_steps"] == before[name]["pull_steps"]
