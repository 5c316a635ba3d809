"""A real Prefect server for the operations tests, and the API calls they make.

Each test module that needs one starts ``prefect server start`` on a free loopback port (once
per module) and drives it with the commands a user types and the API the UI calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from demo.orgs import free_port

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")


def prefect_server_process(home: Path) -> Iterator[dict[str, str]]:
    """Starts a server with its state under ``home``; yields the environment that uses it."""
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        # lean polling, so runs and schedules are picked up within seconds
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        # SQLite stalls a writer up to 60 s and then answers 503: every client of this server
        # (the worker's flow runs too) retries that longer than Prefect's default
        "PREFECT_CLIENT_MAX_RETRIES": "10",
    }
    process = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
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


def _request(method: str, url: str, body: object = None) -> httpx.Response:
    """One API call that rides out a busy server: 503s and timeouts are retried for up to
    five minutes (SQLite stalls writers while a flow run logs heavily on two cores)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            response = httpx.request(method, url, json=body, timeout=60)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        else:
            if response.status_code != 503 or time.monotonic() > deadline:
                response.raise_for_status()
                return response
        time.sleep(2)


def api(env: dict[str, str], path: str, body: dict | list | None = None) -> object:
    """POST to the API (filters, run creation with an idempotency key: safe to repeat)."""
    return _request("POST", f"{env['PREFECT_API_URL']}{path}", body or {}).json()


def api_get(env: dict[str, str], path: str) -> dict:
    return _request("GET", f"{env['PREFECT_API_URL']}{path}").json()


def artifact(env: dict[str, str], key: str) -> dict:
    found = api(env, "/artifacts/latest/filter", {"artifacts": {"key": {"any_": [key]}}})
    assert found, f"no artifact {key}"
    return found[0]


def run_artifacts(env: dict[str, str], run_name: str) -> tuple[dict, dict[str, dict]]:
    """The latest flow run named ``run_name`` and its artifacts by what they are (the key's
    last part: ``rounds``, ``charts``, ``summary``...)."""
    runs = api(env, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [run_name]}},
                                          "sort": "START_TIME_DESC", "limit": 1})  # fmt: skip
    assert runs, f"no flow run {run_name!r}"
    found = api(env, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [runs[0]["id"]]}}})
    return runs[0], {a["key"].rsplit("-", 1)[1]: a for a in found if a.get("key")}


def run_logs(env: dict[str, str], run_id: str) -> list[str]:
    """The messages a flow run logged (its task runs' included), oldest first."""
    logs = api(env, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                     "sort": "TIMESTAMP_ASC", "limit": 200})  # fmt: skip
    return [entry["message"] for entry in logs]
