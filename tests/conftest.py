"""Shared fixtures: one Prefect test server per session, and a private workspace per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# The test process opts into small Paillier keys (1024 or 512 bits: seconds, not minutes);
# the tests of refusal remove the switch, and party processes get it only when a test says so.
os.environ["PRIVREG_INSECURE_TEST_KEYS"] = "1"
if worker := os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers: one
    home = Path(os.environ.get("PREFECT_HOME", "var/prefect")) / worker  # Prefect home each
    home.mkdir(parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(home.resolve())


#: Modules that take minutes (real servers, party processes), started first: `make test` hands
#: whole files to two workers in this order, so the long ones run side by side, not last.
SLOW_FIRST = (
    "test_operations.py",
    "test_resume.py",
    "test_federation.py",
    "test_psi_kkrt_flow.py",
    "test_horizontal_parties.py",
    "test_vertical_parties.py",
    "test_pipeline_parties.py",
    "test_hospitals_job_start.py",
    "test_sparse_lda_parties.py",
    "test_walr_parties.py",
    "test_vertical_flow.py",
    "test_psi_flow.py",
    "test_label_dp_flow.py",
    "test_horizontal_flow.py",
    "test_party_processes.py",
    "test_wheel_install.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A temporary Prefect API for flow tests (started once, ~10 s)."""
    from prefect.settings import (
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        PREFECT_SERVER_DATABASE_TIMEOUT,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    results = tmp_path_factory.mktemp("prefect-results")
    with (
        temporary_settings(  # party processes share this server: writers wait for SQLite's
            {  # lock up to a minute instead of getting a 503 after ten seconds
                PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                PREFECT_RESULTS_LOCAL_STORAGE_PATH: results,
                PREFECT_SERVER_DATABASE_TIMEOUT: 60.0,
            }
        ),
        prefect_test_harness(server_startup_timeout=180),
    ):
        yield


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A fresh folder for party databases and the channel."""
    root = tmp_path / "ws"
    root.mkdir()
    return root
