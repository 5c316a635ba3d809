"""The accountant composes a table's releases with dp-accounting's PLDs: its figures are
dp-accounting's own, never below the analytic single-Gaussian bound; the ledger charges by
them (thirty WALR-like releases fit where adding up refuses the eleventh), migrates an old
ledger's rows as approximate-DP events, and ``privreg budget show`` prints the same figure
and how many more runs fit."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy.optimize import brentq

from core.dp.accounting import (
    AccountingError,
    ApproximateDP,
    Charge,
    Composed,
    DiscreteGaussian,
    DiscreteLaplace,
    Gaussian,
    Laplace,
    PureDP,
    RandomizedResponse,
    basic_epsilon,
    composed_epsilon,
    event_from_dict,
    pld_epsilon,
    rdp_epsilon,
    runs_left,
)
from core.dp.gaussian import analytic_gaussian_delta, analytic_gaussian_sigma
from core.walr import WalrFeatures, walr_sigma
from privreg.cli import main
from storage.ledger import BudgetError, PrivacyLedger
from storage.party_store import PartyStore

OWNER_DELTA = 1e-5


def dp_accounting_epsilon(event: dp_event.DpEvent, delta: float, replace: bool = False) -> float:
    """dp-accounting's own PLD accountant on the same releases."""
    relation = NeighboringRelation.REPLACE_ONE if replace else NeighboringRelation.ADD_OR_REMOVE_ONE
    accountant = PLDAccountant(relation)
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def walr_like_event(features: int = 4) -> DiscreteGaussian:
    """A binary-mode WALR release calibrated for (1, 1e-6) by the project's own calibration:
    discrete Gaussian noise, one label moving each of features + 1 sums by 0 or 1."""
    shape = WalrFeatures(np.zeros((100_000, features)), tuple(f"x{j}" for j in range(features)),
                         1.0, math.sqrt(features), True, "binary")  # fmt: skip
    return DiscreteGaussian(shape.sensitivity, walr_sigma(1.0, 1e-6, shape), "unit")


def owner_store(tmp_path: Path, epsilon: float, delta: float = OWNER_DELTA) -> PartyStore:
    store = PartyStore(tmp_path / "clinic.duckdb")
    store.write_table("patients", pd.DataFrame({"id": [1, 2, 3]}))
    PrivacyLedger(store).set_budget("patients", epsilon, delta)
    return store


# ---- the accountant ----------------------------------------------------------------------------
def test_gaussian_and_laplace_figures_are_dp_accountings_own() -> None:
    sigma = analytic_gaussian_sigma(1.0, 1e-6, 1.0)
    assert pld_epsilon([Gaussian(1.0, sigma)] * 30, OWNER_DELTA) == pytest.approx(
        dp_accounting_epsilon(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), 30),
                              OWNER_DELTA), abs=1e-6)  # fmt: skip
    mixed = [Gaussian(2.0, 5.0)] * 3 + [Laplace(1.0, 2.0)] * 2
    expected = dp_accounting_epsilon(
        dp_event.ComposedDpEvent([
            dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(2.5), 3),
            dp_event.SelfComposedDpEvent(dp_event.LaplaceDpEvent(2.0), 2),
        ]),
        OWNER_DELTA,
    )  # fmt: skip
    assert pld_epsilon(mixed, OWNER_DELTA) == pytest.approx(expected, abs=1e-6)


def test_randomized_response_and_discrete_figures_are_dp_accountings_own() -> None:
    noise = 4 / (math.exp(1.0) + 3)  # 4-ary RR at epsilon 1: uniform with probability p
    # five events listed: dp-accounting 0.6.0's PLD accountant composes a self-composed
    # randomized response only once
    rr = dp_event.ComposedDpEvent([dp_event.RandomizedResponseDpEvent(noise, 4)] * 5)
    assert pld_epsilon([RandomizedResponse(1.0, 4)] * 5, OWNER_DELTA) == pytest.approx(
        dp_accounting_epsilon(rr, OWNER_DELTA, replace=True), abs=1e-6
    )
    walr = walr_like_event(features=3)
    unit = pld_lib.from_discrete_gaussian_mechanism(walr.sigma, 1, use_connect_dots=True)
    assert pld_epsilon([walr] * 7, OWNER_DELTA) == pytest.approx(
        unit.self_compose(4 * 7).get_epsilon_for_delta(OWNER_DELTA), abs=1e-6
    )
    laplace = pld_lib.from_discrete_laplace_mechanism(1 / 3.0, sensitivity=2)
    assert pld_epsilon([DiscreteLaplace(2, 3.0)] * 4, OWNER_DELTA) == pytest.approx(
        laplace.self_compose(4).get_epsilon_for_delta(OWNER_DELTA), abs=1e-6
    )
    worst = [common.DifferentialPrivacyParameters(e, d) for e, d in ((0.3, 0.0), (1.0, 1e-6))]
    plds = [pld_lib.from_privacy_parameters(p) for p in worst]
    events = [PureDP(0.3), ApproximateDP(1.0, 1e-6)]
    assert pld_epsilon(events, OWNER_DELTA) == pytest.approx(
        plds[0].compose(plds[1]).get_epsilon_for_delta(OWNER_DELTA), abs=1e-6
    )


@pytest.mark.parametrize(("sensitivity", "sigma", "delta"), [(1.0, 4.0, 1e-6), (3.0, 2.5, 1e-5)])
def test_one_gaussian_is_never_below_the_analytic_gaussian_bound(
    sensitivity: float, sigma: float, delta: float
) -> None:
    """Balle and Wang's exact epsilon(delta) of one Gaussian: the PLD's pessimistic figure is
    at or just above it (its grid rounds losses up)."""
    exact = brentq(lambda e: analytic_gaussian_delta(sigma, e, sensitivity) - delta, 1e-6, 50.0)
    figure = pld_epsilon([Gaussian(sensitivity, sigma)], delta)
    assert exact - 1e-9 <= figure <= exact + 1e-3


def test_the_walr_calibration_reads_back_as_its_own_epsilon_and_rdp_is_looser() -> None:
    walr = walr_like_event()
    assert 0.999 <= pld_epsilon([walr], 1e-6) <= 1.0 + 1e-4  # exact discrete accounting
    thirty = pld_epsilon([walr] * 30, OWNER_DELTA)
    assert 5.5 < thirty < 6.5  # the "about 5.9"
    rdp = rdp_epsilon([walr] * 30, OWNER_DELTA)
    assert rdp is not None and thirty <= rdp
    assert rdp_epsilon([ApproximateDP(1.0, 1e-6)], OWNER_DELTA) is None  # no RDP form


@pytest.mark.parametrize(("sigma", "shift"), [(1024.0, 300), (2048.0, 5000)])
def test_a_fine_grid_vector_shift_is_counted_above_the_exact_discrete_figure(
    sigma: float, shift: int
) -> None:
    """Where dp-accounting has the exact discrete PLD (one coordinate), the vector rule's
    continuous Gaussian with one more step of sensitivity is above it."""
    exact = pld_lib.from_discrete_gaussian_mechanism(sigma, shift, use_connect_dots=True)
    for delta in (1e-6, 1e-3):
        counted = pld_epsilon([DiscreteGaussian(float(shift), sigma, "vector")], delta)
        assert counted > exact.get_epsilon_for_delta(delta)


def test_events_are_small_json_dicts_and_unknown_ones_are_refused() -> None:
    events = [walr_like_event(), Gaussian(1.0, 3.0), Laplace(1.0, 2.0), DiscreteLaplace(2, 4.0),
              RandomizedResponse(1.0, 3), ApproximateDP(1.0, 1e-6),
              Composed((PureDP(0.2), PureDP(0.8)))]  # fmt: skip
    for event in events:
        assert event_from_dict(json.loads(json.dumps(event.as_dict()))) == event
    prior_and_channel = Composed((PureDP(0.2), PureDP(0.8)))
    assert prior_and_channel.describe() == "pure(epsilon=0.2) + pure(epsilon=0.8)"
    for bad in ({"mechanism": "subsampled"}, {"mechanism": "gaussian", "sigma": 1.0},
                {"mechanism": "gaussian", "sensitivity": 1.0, "sigma": -1.0},
                {"mechanism": "discrete_gaussian", "sensitivity": 2.5, "sigma": 4.0},
                {"mechanism": "discrete_gaussian", "sensitivity": 70.0, "sigma": 300.0,
                 "shift": "vector"}):  # fmt: skip
        with pytest.raises(AccountingError):
            event_from_dict(bad)


def test_runs_left_stops_exactly_at_the_boundary() -> None:
    """Pure releases at delta 0 add up exactly: 1 + 4 x 0.5 is 3, a fifth would be 3.5."""
    spent = [Charge(PureDP(1.0), 1.0, 0.0)]
    run = Charge(PureDP(0.5), 0.5, 0.0)
    assert runs_left(spent, run, 3.0, 0.0) == 4
    assert runs_left(spent, run, 2.999, 0.0) == 3
    assert composed_epsilon(spent + [run] * 4, 0.0) == pytest.approx(3.0, abs=1e-12)


# ---- the ledger and the command ----------------------------------------------------------------
def test_thirty_walr_releases_fit_where_adding_up_refuses_the_eleventh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    walr = walr_like_event()
    charge = Charge(walr, 1.0, 1e-6)
    assert basic_epsilon([charge] * 10, OWNER_DELTA) == pytest.approx(10.0)
    assert basic_epsilon([charge] * 11, OWNER_DELTA) == math.inf  # basic: the 11th is refused
    store = owner_store(tmp_path, 10.0)
    ledger = PrivacyLedger(store)
    for night in range(30):
        ledger.charge_and_store(f"night-{night}", "patients", 1.0, 1e-6, "walr-discrete-gaussian",
                                "nightly-walr", {"night": night}, event=walr)  # fmt: skip
    figure = pld_epsilon([walr] * 30, OWNER_DELTA)
    status = ledger.status("patients")
    assert status.epsilon_spent == pytest.approx(figure, abs=1e-12) and figure < 10.0
    assert main(["budget", "show", "--database", str(store.path), "--json"]) == 0
    [shown] = json.loads(capsys.readouterr().out)
    assert shown["epsilon_spent"] == pytest.approx(figure, abs=1e-12)
    assert shown["delta_total"] == OWNER_DELTA and len(shown["spends"]) == 30
    assert shown["spends"][0]["event"] == walr.as_dict()
    [job] = shown["jobs"]
    more = runs_left([charge] * 30, charge, 10.0, OWNER_DELTA)
    assert job["job_id"] == "nightly-walr" and job["runs_left"] == more > 0
    assert main(["budget", "show", "--database", str(store.path)]) == 0
    text = capsys.readouterr().out
    assert f"{figure:g}" in text.splitlines()[1]  # the status row prints the PLD figure
    assert f"nightly-walr: {more} more runs of discrete_gaussian(" in text


def test_the_ledger_admits_exactly_the_runs_it_promises(tmp_path: Path) -> None:
    sigma = analytic_gaussian_sigma(1.0, 1e-6, 1.0)
    event = Gaussian(1.0, sigma)
    ledger = PrivacyLedger(owner_store(tmp_path, 3.0))
    ledger.charge_and_store("r0", "patients", 1.0, 1e-6, "gaussian", "job", [0], event=event)
    [plan] = ledger.plan("patients")
    promised = plan["runs_left"]
    assert promised >= 1
    for run in range(1, promised + 1):
        ledger.charge_and_store(f"r{run}", "patients", 1.0, 1e-6, "gaussian", "job", [run],
                                event=event)  # fmt: skip
    with pytest.raises(BudgetError, match="exceeds the budget"):
        ledger.charge_and_store("over", "patients", 1.0, 1e-6, "gaussian", "job", [9], event=event)
    assert ledger.plan("patients")[0]["runs_left"] == 0


OLD_BUDGET_SCHEMA = """CREATE TABLE privreg_budget (
    protected_table VARCHAR PRIMARY KEY, epsilon_total DOUBLE NOT NULL,
    delta_total DOUBLE NOT NULL, updated_at TIMESTAMP NOT NULL)"""
OLD_SPEND_SCHEMA = """CREATE TABLE privreg_spend (
    release_key VARCHAR PRIMARY KEY, protected_table VARCHAR NOT NULL,
    epsilon DOUBLE NOT NULL, delta DOUBLE NOT NULL, mechanism VARCHAR NOT NULL,
    job_id VARCHAR NOT NULL, created_at TIMESTAMP NOT NULL, consumer VARCHAR)"""


def test_an_old_ledger_migrates_its_rows_as_approximate_dp_events(tmp_path: Path) -> None:
    store = PartyStore(tmp_path / "clinic.duckdb")
    store.write_table("patients", pd.DataFrame({"id": [1, 2, 3]}))
    old = [(0.5, 1e-6), (1.0, 0.0), (0.25, 2e-6)]
    start = datetime(2030, 1, 1)
    with duckdb.connect(str(store.path)) as con:  # the ledger written the old way: no events
        con.execute(OLD_BUDGET_SCHEMA)
        con.execute(OLD_SPEND_SCHEMA)
        con.execute("INSERT INTO privreg_budget VALUES ('patients', 5.0, ?, ?)",
                    [OWNER_DELTA, start])  # fmt: skip
        for i, (epsilon, delta) in enumerate(old):
            when = start + timedelta(hours=i)
            con.execute("INSERT INTO privreg_spend VALUES (?, 'patients', ?, ?, 'walr', 'job', "
                        "?, NULL)", [f"old-{i}", epsilon, delta, when])  # fmt: skip
    ledger = PrivacyLedger(store)
    charges = [Charge(ApproximateDP(e, d), e, d) for e, d in old]
    assert ledger.status("patients").epsilon_spent == pytest.approx(
        composed_epsilon(charges, OWNER_DELTA), abs=1e-12
    )
    events = [json.loads(s["event"]) for s in ledger.spends("patients")]
    assert events == [{"mechanism": "approximate", "epsilon": e, "delta": d} for e, d in old]
    with duckdb.connect(str(store.path)) as con:
        missing = con.execute("SELECT count(*) FROM privreg_spend WHERE event IS NULL").fetchone()
    assert missing == (0,)


def test_a_spend_the_accountant_cannot_read_refuses_every_release(tmp_path: Path) -> None:
    store = owner_store(tmp_path, 5.0)
    ledger = PrivacyLedger(store)
    ledger.charge_and_store("r0", "patients", 0.5, 0.0, "test", "job", [0])
    with duckdb.connect(str(store.path)) as con:
        con.execute("UPDATE privreg_spend SET event = ?", [json.dumps({"mechanism": "subsampled"})])
    with pytest.raises(BudgetError, match="cannot be accounted"):
        ledger.require_affordable("patients", 0.1, 0.0)
    with pytest.raises(BudgetError, match="cannot be accounted"):
        ledger.charge_and_store("r1", "patients", 0.1, 0.0, "test", "job", [1])
    assert ledger.stored_release("r1") is None
