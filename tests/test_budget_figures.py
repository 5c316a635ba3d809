"""``privreg budget show`` reads the figures each charge stored (no dp-accounting to import, no
runs-left search), and they are the figures the accountant computes; stale or absent ones (a
changed budget, a ledger from before they were stored) are computed again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from core.dp.accounting import PureDP
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore

ROOT = Path(__file__).resolve().parents[1]
SHOW = """
import json, sys
from privreg.cli import main
code = main(sys.argv[1:])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"dp_accounting", "scipy"})
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _show(database: Path, *extra: str) -> tuple[str, list[str]]:
    """``privreg budget show`` in a fresh process: what it prints, and the heavy packages it
    imported."""
    done = subprocess.run(
        [sys.executable, "-c", SHOW, "budget", "show", "--database", str(database), *extra],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] == 0, done.stderr
    return done.stdout, report["heavy"]


def _fresh(ledger: PrivacyLedger) -> tuple[dict[str, object], list[dict[str, object]]]:
    """The figures computed now, by the paths checks and charges use."""
    return ledger.status("patients").as_dict(), ledger.plan("patients")


def _stored(ledger: PrivacyLedger) -> tuple[str, float, dict[str, int]]:
    """The figures row as the last charge left it: fingerprint, spend, runs left per job."""
    with duckdb.connect(str(ledger.store.path)) as con:
        row = con.execute("SELECT fingerprint, epsilon_spent, runs_left FROM privreg_figures "
                          "WHERE protected_table = 'patients'").fetchone()  # fmt: skip
    return row[0], row[1], json.loads(row[2])


def _as_stored(fresh: tuple[dict[str, object], list[dict[str, object]]]) -> tuple[object, ...]:
    return fresh[0]["epsilon_spent"], {p["job_id"]: p["runs_left"] for p in fresh[1]}


@pytest.fixture(scope="module")
def charged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two jobs' releases on one table, interleaved (pure DP, cheap to compose); the stored
    figures are checked against the accountant's after the nightly job's second release (its
    runs left counted from the stored figures, one fewer) and, in the tests, at the end."""
    store = PartyStore(tmp_path_factory.mktemp("ledger") / "clinic.duckdb")
    store.write_table("patients", pd.DataFrame({"id": [1, 2, 3]}))
    ledger = PrivacyLedger(store)
    ledger.set_budget("patients", 6.0, 1e-5)
    nightly, labels = PureDP(0.5), PureDP(0.3)
    for key, job, epsilon, delta, event in [("w0", "nightly", 0.5, 0.0, nightly),
                                            ("p0", "labels", 0.3, 0.0, labels),
                                            ("w1", "nightly", 0.5, 0.0, nightly),
                                            ("p1", "labels", 0.3, 0.0, labels)]:  # fmt: skip
        ledger.charge_and_store(key, "patients", epsilon, delta, "m", job, [key], event=event)
        if key == "w1":
            assert _stored(ledger)[1:] == _as_stored(_fresh(ledger))
    return store.path


def _copy(charged: Path, tmp_path: Path) -> PrivacyLedger:
    shutil.copy(charged, tmp_path / charged.name)
    return PrivacyLedger(PartyStore(tmp_path / charged.name))


def test_show_reads_the_stored_figures_and_they_are_the_accountants(
    charged: Path, tmp_path: Path
) -> None:
    ledger = _copy(charged, tmp_path)
    database = ledger.store.path
    fingerprint, spent, runs = _stored(ledger)
    status, plans = _fresh(ledger)
    assert (spent, runs) == _as_stored((status, plans)) and min(runs.values()) > 0
    assert ledger.report("patients") == (ledger.status("patients"), plans)
    assert _stored(ledger)[0] == fingerprint  # read, not computed again
    assert [p["job_id"] for p in plans] == ["labels", "nightly"]  # latest job first
    assert [c.event for c in ledger.charges("patients")] == [PureDP(0.5), PureDP(0.3)] * 2
    text, heavy = _show(database)
    assert heavy == []  # the charges stored the figures: nothing composed here
    assert f"labels: {runs['labels']} more runs of pure(epsilon=0.3)" in text
    shown, heavy = _show(database, "--json")
    assert heavy == []
    [table] = json.loads(shown)
    assert table["epsilon_spent"] == status["epsilon_spent"]
    assert {p["job_id"]: p["runs_left"] for p in table["jobs"]} == runs
    with duckdb.connect(str(database)) as con:  # a ledger from before figures were stored
        con.execute("DROP TABLE privreg_figures")
    recomputed, heavy = _show(database)
    assert recomputed == text and heavy == ["dp_accounting", "scipy"]
    again, heavy = _show(database, "--json")  # stored by the show before: read again
    assert again == shown and heavy == []


def test_a_budget_changed_behind_the_figures_is_composed_again(
    charged: Path, tmp_path: Path
) -> None:
    ledger = _copy(charged, tmp_path)
    before = ledger.report("patients")
    with duckdb.connect(str(ledger.store.path)) as con:  # as an older privreg would change it
        con.execute("UPDATE privreg_budget SET epsilon_total = 4.0, delta_total = 1e-4")
    status, plans = ledger.report("patients")
    assert (status.as_dict(), plans) == _fresh(ledger)
    assert status.epsilon_spent < before[0].epsilon_spent  # composed at the new delta
    assert plans[0]["runs_left"] < before[1][0]["runs_left"]
    ledger.set_budget("patients", 6.0, 1e-5)  # the owner's command stores them again
    fingerprint = _stored(ledger)[0]
    assert ledger.report("patients") == before and _stored(ledger)[0] == fingerprint
