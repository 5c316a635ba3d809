"""A job file never grants a budget to a party service: only the table's owner does, with
``privreg budget set`` or its own party.toml; a release against a table without one is refused
before anything is charged, saying how to set it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from prefect.logging import disable_run_logger

from federation.channel import Channel
from federation.party_config import ENV_VAR
from storage.descriptor import TableRef
from storage.ledger import BudgetError, PrivacyLedger
from storage.owner_budgets import OwnerBudgetError, owner_budgets
from storage.party_store import PartyStore
from tasks import label_dp
from tasks.loading import load_table

JOB_FILE_BUDGET = {"epsilon": 5.0, "delta": 0.0}  # what a partner's job file asks for


def registry(tmp_path: Path, budgets: str = "") -> tuple[TableRef, Path]:
    """The registry runs as a party service (its own party.toml) and has a labels file."""
    config = tmp_path / "party.toml"
    config.write_text(
        'party = "registry"\nroot = "home"\n\n[tls]\nca = "ca.pem"\ncert = "r.pem"\n'
        f'key = "r.key"\n\n[peers]\nclinic = "127.0.0.1:1"\n{budgets}'
    )
    rng = np.random.default_rng(0)
    source = tmp_path / "progression.csv"
    pd.DataFrame({"id": range(40), "y": rng.integers(0, 20, 40)}).to_csv(source, index=False)
    ref = TableRef(str(tmp_path / "registry.duckdb"), "progression", label_column="y")
    return ref, source


def release(ref: TableRef, workspace: Path) -> dict:
    job = label_dp.LabelDPJob(
        job_id="budgetless", channel=Channel(workspace, "budgetless"), labels_party="registry",
        features_party="clinic", epsilon=1.0, loss="squared", label_range=(0.0, 20.0),
    )  # fmt: skip
    with disable_run_logger():
        return label_dp.release_noisy_labels.fn(job, ref)


def test_a_job_files_budget_is_not_granted_and_the_release_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, source = registry(tmp_path)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "party.toml"))
    with disable_run_logger():
        load_table.fn(str(source), ref, JOB_FILE_BUDGET)
    ledger = PrivacyLedger(PartyStore.of(ref))
    assert ledger.budgets() == []  # the job file granted nothing
    with pytest.raises(BudgetError, match=r"privreg budget set --database .* --table progression"):
        release(ref, tmp_path)
    assert ledger.spends() == []  # nothing charged, nothing stored
    assert ledger.budgets() == []


def test_the_owners_party_toml_grants_it_and_the_job_file_still_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, source = registry(tmp_path, "\n[budgets.progression]\nepsilon = 2.0\ndelta = 0.0\n")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "party.toml"))
    with disable_run_logger():
        load_table.fn(str(source), ref, JOB_FILE_BUDGET)
    ledger = PrivacyLedger(PartyStore.of(ref))
    assert ledger.status("progression").epsilon_total == 2.0  # the owner's, not the job's 5
    monkeypatch.delenv(ENV_VAR)  # the release's message then goes through the local channel
    assert release(ref, tmp_path)["budget"]["epsilon_spent"] == 1.0


def test_the_embedded_operators_job_file_is_its_own(tmp_path: Path, monkeypatch) -> None:
    ref, source = registry(tmp_path)
    monkeypatch.delenv(ENV_VAR, raising=False)
    with disable_run_logger():
        load_table.fn(str(source), ref, JOB_FILE_BUDGET)
    assert PrivacyLedger(PartyStore.of(ref)).status("progression").epsilon_total == 5.0


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("epsilon = 0.0", "epsilon > 0"),
        ('epsilon = "4"', "epsilon must be a number"),
        ("epsilon = 1.0\ndelta = 1.0", "0 <= delta < 1"),
        ("epsilon = 1.0\nepsilons = 2.0", "takes epsilon and an optional delta"),
    ],
)
def test_an_unusable_owner_budget_is_refused_naming_file_and_table(
    tmp_path: Path, entry: str, problem: str
) -> None:
    config = tmp_path / "party.toml"
    config.write_text(f"[budgets.patients]\n{entry}\n")
    with pytest.raises(OwnerBudgetError, match=rf"party.toml: \[budgets.patients\].*{problem}"):
        owner_budgets(config)
