"""``privreg score``: the scores it writes are the ``score_local`` flow's on the same table and
model, and a wrong model, a missing column or a vertical share is one line naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
from prefect.logging.configuration import ensure_logging_setup
from test_cli import _error_line

from core.model_format import ModelRecord
from privreg.cli import main
from storage.descriptor import TableRef
from storage.models import ModelStore, model_key
from storage.party_store import PartyStore

ensure_logging_setup()  # Prefect's console handler on the real stderr, not on a test's capture

FEATURES = ["age", "bmi", "glucose"]
JOB = "horizontal-0123456789abcdef"
KEY = model_key("horizontal", JOB)
ROOT = Path(__file__).resolve().parents[1]


def _hospital(folder: Path) -> tuple[TableRef, pd.DataFrame]:
    """A hospital's new rows (ids 0-39, labels) and a horizontal model promoted for job
    "monthly" that trained on ids 0-19 and held out 20-24."""
    rng = np.random.default_rng(3)
    frame = pd.DataFrame({"id": range(40), **{f: rng.normal(size=40) for f in FEATURES}})
    frame["y"] = (frame["age"] + rng.normal(size=40) > 0).astype(int)
    ref = TableRef(str(folder / "hospital.duckdb"), "intake", label_column="y", party="hospital")
    PartyStore.of(ref).import_frame(frame, ref)
    model = ModelRecord.linear("horizontal", JOB, FEATURES, [0.75, -1.5, 0.25], -0.5, job="monthly")
    models = ModelStore(PartyStore.of(ref))
    models.save(KEY, model, range(20), range(20, 25))
    models.promote(KEY)
    share = ModelRecord.linear("vertical", "v-job", ["age"], [1.0], 0.1, party="hospital",
                               share=True)  # fmt: skip
    models.save(model_key("vertical", "v-job", "hospital"), share)
    return ref, frame


def _scores(ref: TableRef) -> pd.DataFrame:
    with duckdb.connect(ref.database, read_only=True) as con:
        return con.execute('SELECT * FROM "intake_scored" ORDER BY id').df()


@pytest.mark.usefixtures("prefect_server")
def test_score_writes_what_the_scoring_flow_writes(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flows.scoring import score_local

    ref, frame = _hospital(workspace)
    flow = score_local(ref.to_dict(), job="monthly", model_flow="horizontal")
    by_flow = _scores(ref)
    argv = ["score", "--database", ref.database, "--table", "intake", "--label-column", "y",
            "--job", "monthly", "--flow", "horizontal", "--log-dir", str(workspace)]  # fmt: skip
    assert main(argv) == 0
    by_command = _scores(ref)
    np.testing.assert_allclose(by_command["score"], by_flow["score"], rtol=1e-12, atol=1e-12)
    pd.testing.assert_frame_equal(by_command, by_flow)
    expected = frame[FEATURES].to_numpy() @ [0.75, -1.5, 0.25] - 0.5
    np.testing.assert_allclose(by_command["score"], expected, rtol=1e-12, atol=1e-12)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"40 rows of intake scored with {KEY} into intake_scored of {ref.database}"
    assert out[1] == "  20 the model trained on, 5 it held out, 15 new to it"
    assert out[2] == f"  AUC {flow['auc']:.4f} against y"

    # new rows from a file, loaded by privreg load's code first (an existing table: --replace)
    source = workspace / "new.csv"
    frame.iloc[30:].to_csv(source, index=False)
    load = ["--source", str(source), "--model", KEY, "--log-dir", str(workspace / "logs")]
    assert main(["score", "--database", ref.database, "--table", "intake", *load]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["score", "--database", ref.database, "--table", "intake", *load,
                 "--replace"]) == 0  # fmt: skip
    np.testing.assert_allclose(_scores(ref)["score"], expected[30:], rtol=1e-12, atol=1e-12)
    assert "10 rows of intake scored" in capsys.readouterr().out


def test_a_wrong_model_or_table_is_one_line_naming_it(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref, _ = _hospital(workspace)
    base = ["score", "--database", ref.database, "--table", "intake"]
    assert _error_line(capsys, base) == (
        "privreg: error: score needs --model KEY or --job JOB (privreg models list shows them)"
    )
    line = _error_line(capsys, [*base, "--model", "models/walr/nope"])
    assert "no model 'models/walr/nope' in hospital.duckdb" in line
    line = _error_line(capsys, [*base, "--job", "yearly"])
    assert "no horizontal model is promoted for job 'yearly'" in line
    line = _error_line(capsys, [*base, "--model", KEY, "--table", "missing"])
    assert line == "privreg: error: hospital.duckdb has no table 'missing' (--source loads one)"
    with duckdb.connect(ref.database) as con:
        con.execute("CREATE TABLE thin AS SELECT id, age, bmi FROM intake")
    line = _error_line(capsys, [*base, "--model", KEY, "--table", "thin"])
    assert line == (
        f"privreg: error: table 'thin' lacks the model's column glucose (model {KEY} reads 3 "
        "columns)"
    )
    line = _error_line(capsys, [*base, "--model", KEY, "--label-column", "outcome"])
    assert line == "privreg: error: table 'intake' has no column 'outcome' (--label-column)"
    share = model_key("vertical", "v-job", "hospital")
    line = _error_line(capsys, [*base, "--model", share])
    assert f"{share} is one party's share of a vertical model" in line
    assert "score_vertical job file" in line and "privreg job start JOB_FILE" in line

    # each refusal came before Prefect: a fresh process loads none of it
    look = (
        "import sys; from privreg.cli import main; "
        f"main({[*base, '--model', 'models/walr/nope']!r}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'flows')))"
    )
    done = subprocess.run([sys.executable, "-c", look], capture_output=True, text=True,
                          cwd=ROOT, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]" and "no model" in done.stderr
