"""The ``privreg`` command: one-line errors with status 1, and models a person can read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.model_format import ModelRecord
from privreg.cli import main
from privreg.option_flags import json_value
from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore
from tasks.horizontal_lr import model_key, model_record


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(argv))
    assert exited.value.code == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # no traceback
    assert "Traceback" not in captured.err
    return lines[0]


def test_errors_are_one_line_with_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("id,label,x\n1,0,0.5\n7,1,abc\n3,0,0.1\n")
    database = tmp_path / "clinic.duckdb"
    line = _error_line(
        capsys,
        ["load", str(bad), "--database", str(database), "--table", "t", "--label-column", "label"],
    )
    assert "table 't'" in line and "column 'x'" in line and "row 2 (id 7)" in line
    assert "np." not in line  # plain numbers, not np.int64(7)
    assert not database.exists() or not PartyStore(database).has_table("t")  # nothing written

    missing = tmp_path / "missing.duckdb"
    line = _error_line(capsys, ["models", "show", "--database", str(missing), "--key", "k"])
    assert line == f"privreg: error: database {missing} does not exist"
    line = _error_line(capsys, ["run", str(tmp_path / "nojob.json")])
    assert "nojob.json does not exist" in line
    line = _error_line(capsys, ["models", "frobnicate", "--database", str(missing)])
    assert "invalid choice: 'frobnicate'" in line
    line = _error_line(capsys, ["models", "show", "--database", str(missing)])
    assert line == "privreg: error: models show needs --key"


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--debug", "models", "list", "--database", str(tmp_path / "x.duckdb")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("x.duckdb does not exist")


def test_models_list_and_show_every_flow_s_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Models of every flow are listed (not other artifacts), and ``show`` prints the
    coefficients by feature name and the intercept, a vertical share's at the guest."""
    store = PartyStore(tmp_path / "coordinator.duckdb")
    record = model_record("horizontal-lr-abc", ["age", "bmi"], np.array([0.25, -1.5, 0.125]), 4)
    ArtifactStore(store).put(model_key("horizontal-lr-abc"), record, "model")
    vertical = ModelRecord.linear(
        "vertical", "job", ["glucose"], [2.0], 0.5, party="clinic", share=True
    )
    ArtifactStore(store).put("models/vertical/job/clinic", vertical.to_dict(), "model")
    ArtifactStore(store).put("vertical/job/round/0000001", {"weights": np.zeros(2)}, "round-state")

    assert main(["models", "list", "--database", str(store.path)]) == 0
    listed = capsys.readouterr().out
    assert model_key("horizontal-lr-abc") in listed
    assert "models/vertical/job/clinic" in listed and "round-state" not in listed
    assert "vertical/job/round" not in listed

    assert (
        main(
            [
                "models",
                "show",
                "--database",
                str(store.path),
                "--key",
                model_key("horizontal-lr-abc"),
            ]
        )
        == 0
    )
    shown = capsys.readouterr().out.splitlines()
    assert "  intercept: 0.125" in shown
    assert any(line.split() == ["age", "0.25"] for line in shown)
    assert any(line.split() == ["bmi", "-1.5"] for line in shown)
    assert (
        main(
            ["models", "show", "--database", str(store.path), "--key", "models/vertical/job/clinic"]
        )
        == 0
    )
    shown = capsys.readouterr().out.splitlines()
    assert "  intercept: 0.5" in shown and any(line.split() == ["glucose", "2"] for line in shown)


def test_party_options_are_inline_json_of_any_length_or_a_file(tmp_path: Path) -> None:
    """A job's options with its preprocessing run past 255 bytes, the longest file name: they
    are read as JSON, not looked up as a path (which failed with 'File name too long')."""
    options = {"preprocessing": {"impute": "median"}, "note": "x" * 300}
    assert json_value(json.dumps(options)) == options
    saved = tmp_path / "options.json"
    saved.write_text(json.dumps(options))
    assert json_value(str(saved)) == options
