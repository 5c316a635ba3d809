"""Party mode at ten hospitals: the coordinator and each hospital its own OS process, meeting
only through their messages over mutual TLS (eleven processes).

Why a module of its own: the round's messages grow with the parties (each masked input and
answer goes to every peer, each party checks the sum itself), and only many processes show
that the waits, the broadcasts and the endpoints' limits hold at that size. Kept lean: one
set of organisations for the module, tiny tables, two rounds; the property is the plaintext
model (full-batch gradient descent on the pooled, standardised rows) at every party.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pytest

from core import horizontal_lr as hlr
from core.preprocessing import FittedPreprocessing
from demo.orgs import Org, make_orgs, start
from federation.party_config import PartyConfig
from federation.transport_grpc import serve
from storage.descriptor import TableRef
from storage.party_store import PartyStore

pytestmark = pytest.mark.usefixtures("prefect_server")
COORDINATOR = "coordinator"
HOSPITALS = [f"hospital_{i:02d}" for i in range(10)]
LR, L2, ROUNDS = 0.5, 1e-3, 2


@pytest.fixture(scope="module")
def orgs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Org]]:
    """Eleven organisations, their message endpoints served from this process."""
    folder = tmp_path_factory.mktemp("ten-hospitals")
    orgs = make_orgs(folder, [COORDINATOR, *HOSPITALS], receive_timeout=120)
    servers = [serve(PartyConfig.load(org.config))[0] for org in orgs.values()]
    yield orgs
    for server in servers:
        server.stop(grace=0).wait()


def tables(orgs: dict[str, Org]) -> dict[str, tuple[TableRef, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(10)
    true = np.array([1.0, -1.5, 0.5])
    made = {}
    for i, name in enumerate(HOSPITALS):
        X = rng.normal(loc=0.05 * i, size=(12 + i, 3))
        y = (rng.random(len(X)) < 1 / (1 + np.exp(-X @ true))).astype(int)
        frame = pd.DataFrame(X, columns=["age", "dose", "score"])
        frame.insert(0, "diagnosis", y)
        frame.insert(0, "patient_id", [f"{name}-{r}" for r in range(len(X))])
        ref = TableRef(
            database=str(orgs[name].folder / f"{name}.duckdb"),
            table="patients",
            id_column="patient_id",
            label_column="diagnosis",
            label_domain=(0, 1),
        )
        PartyStore.of(ref).write_table(ref.table, frame)
        made[name] = (ref, X, y.astype(np.float64))
    return made


def test_ten_hospital_processes_train_the_plaintext_model(orgs: dict[str, Org]) -> None:
    from prefect.settings import PREFECT_API_URL

    made = tables(orgs)
    api = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}
    common = ["--job", "ten-hospitals", "--parties", ",".join(HOSPITALS)]
    common += ["--learning-rate", str(LR), "--l2", str(L2), "--join-timeout", "300"]
    runs: dict[str, subprocess.Popen[str]] = {}
    try:
        for party, org in orgs.items():
            args = [*common, "--rounds", str(ROUNDS), "--tol", "0"]
            if party != COORDINATOR:
                args = [*common, "--table", json.dumps(made[party][0].to_dict())]
            with open(org.folder / "stderr.log", "a") as log:
                runs[party] = start(org, "horizontal", args, api, stderr=log)
        results: dict[str, dict[str, Any]] = {}
        for party, run in runs.items():
            out, _ = run.communicate(timeout=900)
            log = (orgs[party].folder / "stderr.log").read_text()
            assert run.returncode == 0, f"{party} failed:\n{log[-3000:]}"
            results[party] = json.loads(out.strip().splitlines()[-1])
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait(timeout=30)

    coordinator = results[COORDINATOR]
    assert coordinator["rounds_completed"] == ROUNDS
    assert all(sorted(e["survivors"]) == HOSPITALS for e in coordinator["history"])
    fitted = FittedPreprocessing.from_dict(coordinator["preprocessing"])
    X = np.vstack([fitted.transform(made[h][1]) for h in HOSPITALS])
    y = np.concatenate([made[h][2] for h in HOSPITALS])
    expected = hlr.init_model(3)
    for _ in range(ROUNDS):
        expected = hlr.apply_mean_gradient(expected, hlr.gradient(expected, X, y, L2), LR)
    np.testing.assert_allclose(coordinator["weights"], expected, atol=1e-6)
    for hospital in HOSPITALS:  # each checked the coordinator's model and kept it
        assert results[hospital]["rounds_completed"] == ROUNDS
        np.testing.assert_array_equal(results[hospital]["weights"], coordinator["weights"])
