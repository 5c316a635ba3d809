"""Four hospitals and a coordinator, each its own process, start a horizontal job file with
``privreg job start``: the file's ``missing_values`` and ``impute`` reach every hospital's
side, and the model equals the one ``privreg run`` trains from the same file, locally.

The hospitals' files mark missing measurements with "?" (a column of text until the job's
``missing_values`` reads it) and leave some cells empty; ``impute: mean`` fills both with the
hospital's own training mean. Nothing is cleaned by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from demo.parties import accept_proposals, prepare, propose_job
from flows.pipeline import pipeline
from storage.models import ModelStore, model_key
from storage.party_store import PartyStore

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c", "hospital_d")
JOB_FILE = "jobs/four_hospitals.json"
MARKED = ("mean_radius", "worst_area")  # columns with "?" and empty cells


def _sources(folder: Path) -> None:
    """The demo's three hospitals' rows split over four, some cells marked missing, and the
    job file naming them (paths as each organisation holds them)."""
    rows = pd.concat(
        [pd.read_csv(ROOT / f"demo/horizontal/hospital_{h}.csv") for h in "abc"],
        ignore_index=True,
    )
    rng = np.random.default_rng(4)
    parties = {}
    shares = np.array_split(np.arange(len(rows)), len(HOSPITALS))
    for number, (party, share) in enumerate(zip(HOSPITALS, shares, strict=True)):
        part = rows.iloc[share].astype({c: object for c in MARKED})
        for column in MARKED:
            hit = rng.choice(len(part), size=6, replace=False)
            part.iloc[hit[:3], part.columns.get_loc(column)] = "?"
            part.iloc[hit[3:], part.columns.get_loc(column)] = None
        source = f"data/{party}.csv"
        (folder / "data").mkdir(exist_ok=True)
        part.to_csv(folder / source, index=False)
        parties[party] = {
            "source": source,
            "table": {
                "database": f"var/parties/{party}.duckdb", "table": "patients", "party": party,
                "id_column": "patient_id", "label_column": "diagnosis", "label_domain": [0, 1],
            },
        }  # fmt: skip
        if number == 0:  # one hospital also declares a marker of its own
            parties[party]["preprocessing"] = {"missing_values": {"worst_area": [-1]}}
    job = {
        "job": "four_hospitals",
        "parties": parties,
        "preprocessing": {"missing_values": {"*": ["?"]}, "impute": "mean"},
        "horizontal_lr": {
            "rounds": 3, "learning_rate": 0.5, "threshold": 3, "holdout_fraction": 0.2,
            "stage_timeout": 300,
        },
    }  # fmt: skip
    (folder / "jobs").mkdir()
    (folder / JOB_FILE).write_text(json.dumps(job))


def _model(database: Path, job_id: str) -> dict[str, float]:
    """A hospital's stored model: each feature's coefficient, and the intercept (key \"\")."""
    record = ModelStore(PartyStore(database)).load(model_key("horizontal", job_id))
    return {**dict(zip(record.features, record.coefficients, strict=True)), "": record.intercept}


def test_four_hospital_processes_start_the_job_file_and_train_the_local_runs_model(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL

    api = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}  # the session's server, shared
    source = tmp_path_factory.mktemp("source")
    _sources(source)
    monkeypatch.chdir(source)  # privreg run reads the job file's paths from where it runs
    local = pipeline(JOB_FILE, workspace=str(source / "var/runs"), run="x")
    assert set(local) == {*HOSPITALS, "coordinator"}
    orgs = prepare(tmp_path_factory.mktemp("orgs"), JOB_FILE, source, receive_timeout=300)
    accept_proposals(orgs, ("hospital_a",))
    propose_job(orgs, "x", JOB_FILE, ("hospital_a",), extra=api, timeout=600, source=source)

    expected = _model(source / "var/parties/hospital_a.duckdb", "four_hospitals-horizontal_lr-x")
    assert all(np.isfinite(list(expected.values())))
    for party in HOSPITALS:  # the same job ids, hold-outs and exact sums: the same model
        database = orgs[party].folder / f"var/parties/{party}.duckdb"
        trained = _model(database, "four_hospitals-horizontal_lr-x")
        assert trained.keys() == expected.keys()
        assert np.allclose(list(trained.values()), list(expected.values()), rtol=0, atol=1e-9)
