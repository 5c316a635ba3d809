"""Checks before anything moves: a party's source lacking a column its entry names, or sizes
that break a rule needing no alignment, are refused from the file's header and row count,
naming party, file and column, at the party's side right after the terms are agreed (before
any table is loaded or PSI runs)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from core.job_checks import LABEL_LEAK_MARGIN, SourceShape, entry_problems
from core.job_schema import MainJob
from storage.sources import source_shape
from storage.validation import DataValidationError

ROOT = Path(__file__).resolve().parents[1]
DEMO = json.loads((ROOT / "jobs" / "demo.json").read_text())
LAB = (ROOT / "demo" / "lab_host.csv").read_text().splitlines()[0].split(",")


def _job(**vertical: object) -> MainJob:
    spec = json.loads(json.dumps(DEMO))
    spec.pop("subjobs")
    spec["vertical"].update(vertical)
    return MainJob.model_validate(spec)


def test_a_source_shape_is_its_header_and_row_count(tmp_path: Path) -> None:
    frame = pd.DataFrame({"id": range(7), "x": range(7)})
    frame.to_csv(tmp_path / "a.csv", index=False)
    with gzip.open(tmp_path / "a.csv.gz", "wt") as packed:
        frame.to_csv(packed, index=False)
    frame.to_parquet(tmp_path / "a.parquet")
    for name in ("a.csv", "a.csv.gz", "a.parquet"):
        assert source_shape(tmp_path / name, "t") == SourceShape(("id", "x"), 7), name
    with pytest.raises(DataValidationError, match=r"missing\.csv: no such file"):
        source_shape(tmp_path / "missing.csv", "t")
    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(DataValidationError, match=r"empty\.csv: the file is empty"):
        source_shape(tmp_path / "empty.csv", "t")


def test_the_demo_job_passes_and_each_broken_rule_is_named() -> None:
    lab = SourceShape(tuple(LAB), 519)
    assert entry_problems(_job(), "host", lab, "demo/lab_host.csv") == []
    features = len(LAB) - 1  # every column but the id
    (small,) = entry_problems(_job(batch_size=80), "host", lab, "demo/lab_host.csv")
    assert small.startswith("party lab (host), file demo/lab_host.csv: 20 features")
    assert f"at least {features + LABEL_LEAK_MARGIN} rows" in small and "batch_size is 80" in small
    few = SourceShape(tuple(LAB), 60)
    assert any(
        "fewer than psi.min_rows = 100" in p for p in entry_problems(_job(), "host", few, "f")
    )
    clinic = SourceShape(("patient_id", "age"), 520)  # no diagnosis column
    (label,) = entry_problems(_job(), "guest", clinic, "demo/clinic_guest.csv")
    assert label == (
        "party clinic (guest), file demo/clinic_guest.csv: no label column 'diagnosis' "
        "(its columns: patient_id, age)"
    )


def test_a_categorical_column_counts_once_per_category() -> None:
    spec = json.loads(json.dumps(DEMO))
    spec.pop("subjobs")
    spec["parties"]["host"]["preprocessing"] = {"categorical": {"stage": list(range(40))}}
    spec["vertical"]["batch_size"] = 100  # 2 features + 64 would fit; 40 + 1 + 64 do not
    shape = SourceShape(("patient_id", "stage", "x"), 500)
    (problem,) = entry_problems(MainJob.model_validate(spec), "host", shape, "f.csv")
    assert "41 features" in problem


def test_a_local_run_refuses_a_batch_too_small_before_any_table_is_loaded(
    tmp_path: Path, prefect_server: None
) -> None:
    from flows.pipeline import pipeline

    spec = json.loads(json.dumps(DEMO))
    spec.pop("subjobs")
    spec.pop("walr")
    spec["vertical"]["batch_size"] = 80
    for entry in spec["parties"].values():
        entry["source"] = str(ROOT / entry["source"])
        entry["table"]["database"] = str(tmp_path / Path(entry["table"]["database"]).name)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(spec))
    with pytest.raises(Exception, match=r"party lab \(host\), file .*lab_host\.csv: 20 features"):
        pipeline(str(job_file), workspace=str(tmp_path))
    assert not (tmp_path / "lab.duckdb").exists()  # the refusing party loaded nothing
    clinic = tmp_path / "clinic.duckdb"  # its peer may have loaded its own rows; no PSI ran
    if clinic.exists():
        with duckdb.connect(str(clinic), read_only=True) as con:
            tables = {
                row[0] for row in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()
            }
        assert not any(name.endswith("_aligned") for name in tables), tables


def test_job_check_opens_the_sources_and_names_each_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from privreg.cli import main

    spec = json.loads(json.dumps(DEMO))
    spec.pop("subjobs")
    spec["parties"]["guest"]["source"] = "clinic.csv"
    spec["parties"]["host"]["source"] = "lab.csv"
    (tmp_path / "job.json").write_text(json.dumps(spec))
    pd.DataFrame({"patient_id": range(150), "age": range(150)}).to_csv(
        tmp_path / "clinic.csv", index=False
    )  # no diagnosis column; lab.csv missing
    monkeypatch.chdir(tmp_path)
    assert main(["job", "check", "job.json"]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        "privreg: error: job.json: its sources do not fit it",
        "party clinic (guest), file clinic.csv: no label column 'diagnosis' (its columns: "
        "patient_id, age)",
        f"party lab (host): table 'measurements': file {tmp_path / 'lab.csv'}: no such file; "
        "check the path",
    ]
    pd.DataFrame({"patient_id": range(150), "x": range(150)}).to_csv(
        tmp_path / "lab.csv", index=False
    )
    (tmp_path / "party.toml").write_text(
        'party = "lab"\nroot = "home"\n[tls]\nca = "ca.pem"\ncert = "lab.pem"\nkey = "lab.key"\n'
    )
    assert main(["job", "check", "job.json", "--config", "party.toml"]) == 0  # its own only
    assert capsys.readouterr().err.strip().endswith("sources checked")
