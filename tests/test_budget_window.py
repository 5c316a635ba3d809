"""Budget windows are enforced at the charge: in the ledger's own serialised transaction, per
table and per consumer, in a window that refreshes; a ledger that cannot be read refuses.

Why at the charge: the standing policy's early check runs when a side starts, minutes before
its release is charged, so two overlapping runs (a schedule and a proposal) could each pass it
and each spend the day's cap.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest

from core.dp.accounting import ApproximateDP, Charge, composed_epsilon
from federation.party_config import ENV_VAR
from privreg.cli import main
from storage.ledger import BudgetError, PrivacyLedger, WindowRule
from storage.party_store import PartyStore


def owner(tmp_path: Path, total: float = 10.0) -> PartyStore:
    store = PartyStore(tmp_path / "clinic.duckdb")
    store.write_table("patients", pd.DataFrame({"id": [1, 2, 3]}))
    PrivacyLedger(store).set_budget("patients", total, 1e-3)
    return store


def total_of(*epsilons: float) -> float:
    """What the table's total counts for these (epsilon, 0) releases: their composition at the
    owner's delta (windows add the epsilons up)."""
    return composed_epsilon([Charge(ApproximateDP(e, 0.0), e, 0.0) for e in epsilons], 1e-3)


def party_toml(tmp_path: Path, policy: str) -> Path:
    path = tmp_path / "party.toml"
    path.write_text(
        'party = "clinic"\nroot = "home"\n\n[tls]\nca = "ca.pem"\ncert = "c.pem"\n'
        f'key = "c.key"\n\n[peers]\nlab = "127.0.0.1:1"\nbank = "127.0.0.1:2"\n\n[policy]\n{policy}'
    )
    return path


def charge_together(store: PartyStore, consumers: list[str], epsilon: float) -> list[str]:
    """Each consumer's release charged from its own thread at the same moment (two runs that
    overlap); what each got: "charged" or the refusal."""
    start, outcome = threading.Barrier(len(consumers)), {}

    def run(consumer: str) -> None:
        ledger = PrivacyLedger(PartyStore(store.path))
        start.wait()
        try:
            ledger.charge_and_store(
                f"release-{consumer}", "patients", epsilon, 0.0, "test", f"job-{consumer}",
                [consumer], consumer=consumer,
            )  # fmt: skip
            outcome[consumer] = "charged"
        except BudgetError as error:
            outcome[consumer] = str(error)

    threads = [threading.Thread(target=run, args=(c,)) for c in consumers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [outcome[c] for c in consumers]


def test_two_overlapping_runs_against_the_policys_daily_cap_spend_at_most_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = owner(tmp_path, total=10.0)  # the total alone would pay for both
    monkeypatch.setenv(ENV_VAR, str(party_toml(tmp_path, "max_epsilon_per_day = 1.0\n")))
    outcome = charge_together(store, ["lab", "bank"], 0.8)
    assert sorted(o == "charged" for o in outcome) == [False, True], outcome
    refusal = next(o for o in outcome if o != "charged")
    assert "exceeds its 1 per day (rule set by the policy)" in refusal
    assert "refreshes at" in refusal
    ledger = PrivacyLedger(store)
    assert ledger.status("patients").epsilon_spent == pytest.approx(total_of(0.8))
    [window] = ledger.windows("patients")
    assert (window.set_by, window.rule.epsilon, window.epsilon_spent) == ("policy", 1.0, 0.8)


def test_the_policys_rule_follows_the_party_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule a party's policy wrote is refreshed by its next check, and removed when the
    policy no longer sets a cap; a local run (no party.toml) leaves the ledger's rules alone."""
    store = owner(tmp_path)
    ledger = PrivacyLedger(store)
    monkeypatch.setenv(ENV_VAR, str(party_toml(tmp_path, "max_epsilon_per_day = 1.0\n")))
    ledger.require_affordable("patients", 0.5, 0.0)
    assert [w.rule.epsilon for w in ledger.windows("patients")] == [1.0]
    second = tmp_path / "second"
    second.mkdir()
    policy = "max_epsilon_per_consumer = 0.3\nbudget_window_hours = 6\n"
    monkeypatch.setenv(ENV_VAR, str(party_toml(second, policy)))
    with pytest.raises(BudgetError, match=r"to lab after 0 spent.*exceeds its 0\.3 per consumer"):
        ledger.charge_and_store("r", "patients", 0.5, 0.0, "test", "job", [1], consumer="lab")
    ledger.require_affordable("patients", 0.5, 0.0)  # a refused charge wrote nothing; this does
    [window] = ledger.windows("patients")
    assert (window.rule.epsilon, window.rule.seconds) == (None, 6 * 3600)
    third = tmp_path / "third"
    third.mkdir()
    monkeypatch.setenv(ENV_VAR, str(party_toml(third, "")))
    ledger.require_affordable("patients", 0.5, 0.0)
    assert ledger.windows("patients") == []
    monkeypatch.delenv(ENV_VAR)
    ledger.set_window("patients", WindowRule(2.0))
    ledger.require_affordable("patients", 0.5, 0.0)  # no party: the owner's rule stays
    assert [(w.set_by, w.rule.epsilon) for w in ledger.windows("patients")] == [("owner", 2.0)]


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def test_the_window_refreshes_and_caps_each_consumer(tmp_path: Path) -> None:
    store = owner(tmp_path)
    clock = Clock(datetime(2030, 1, 1, 10, 0))
    ledger = PrivacyLedger(store, clock=clock)
    ledger.set_window("patients", WindowRule(1.0, epsilon_per_consumer=0.6))
    ledger.charge_and_store("a", "patients", 0.5, 0.0, "test", "job-a", [1], consumer="lab")
    with pytest.raises(BudgetError, match=r"to lab after 0\.5 spent for it"):
        ledger.charge_and_store("b", "patients", 0.5, 0.0, "test", "job-b", [2], consumer="lab")
    clock.now = datetime(2030, 1, 1, 23, 59)
    ledger.charge_and_store("c", "patients", 0.4, 0.0, "test", "job-c", [3], consumer="bank")
    with pytest.raises(BudgetError, match="refreshes at 2030-01-02 00:00 UTC"):
        ledger.charge_and_store("d", "patients", 0.2, 0.0, "test", "job-d", [4], consumer="bank")
    [window] = ledger.windows("patients")
    assert window.by_consumer == pytest.approx({"lab": 0.5, "bank": 0.4})
    assert window.refreshes_at == datetime(2030, 1, 2)
    clock.now = datetime(2030, 1, 2, 0, 0, 1)  # a new window: its spend starts from 0
    ledger.charge_and_store("d", "patients", 0.6, 0.0, "test", "job-d", [4], consumer="lab")
    [window] = ledger.windows("patients")
    assert (window.start, window.epsilon_spent) == (datetime(2030, 1, 2), pytest.approx(0.6))
    total = ledger.status("patients").epsilon_spent
    assert total == pytest.approx(total_of(0.5, 0.4, 0.6))  # the total counts all windows


def test_a_ledger_held_locked_past_the_timeout_refuses_the_release(tmp_path: Path) -> None:
    store = owner(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time\n"
         f"con = duckdb.connect({str(store.path)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        ledger = PrivacyLedger(store, lock_timeout=0.5)
        for attempt in (
            lambda: ledger.require_affordable("patients", 0.1, 0.0),
            lambda: ledger.charge_and_store("r", "patients", 0.1, 0.0, "test", "job", [1]),
        ):
            with pytest.raises(BudgetError, match=r"cannot be read .*the release is refused"):
                attempt()
    finally:
        holder.kill()
        holder.wait()
    assert PrivacyLedger(store).spends() == []
    assert PrivacyLedger(store).stored_release("r") is None


def test_budget_show_prints_the_windows_spend_and_when_it_refreshes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = owner(tmp_path)
    database = str(store.path)
    assert main(["budget", "window", "--database", database, "--table", "patients",
                 "--epsilon", "1", "--per-consumer", "0.5"]) == 0  # fmt: skip
    PrivacyLedger(store).charge_and_store(
        "r", "patients", 0.25, 0.0, "test", "job", [1], consumer="lab"
    )
    capsys.readouterr()
    assert main(["budget", "show", "--database", database]) == 0
    shown = capsys.readouterr().out
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%d 00:00:00 UTC")
    assert "windows of patients:" in shown and tomorrow in shown
    assert "owner window: lab spent 0.25" in shown
    assert main(["budget", "window", "--database", database, "--table", "patients", "--off"]) == 0
    assert PrivacyLedger(store).windows("patients") == []
