"""Label-DP regression flow: one audited release, charged once, refused before computing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from helpers import chart_images, relocate_job
from prefect.artifacts import Artifact
from prefect.exceptions import ParameterTypeError
from prefect.logging import disable_run_logger

from core.ids import id_order_digest
from core.job_schema import LabelDPOptions
from core.label_dp import InvalidEpsilonError, train_on_noisy_labels
from federation.channel import Channel
from federation.workspace import channel_for
from flows.label_dp import label_dp_party, label_dp_regression
from flows.pipeline import pipeline
from storage import codec
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import BudgetError, PrivacyLedger
from storage.party_store import PartyStore
from storage.validation import DataValidationError
from tasks import label_dp as steps
from tasks.reporting import short_id

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
ROWS = 300
OPTIONS = {"epsilon": 1.0, "label_range": [0, 20], "integer_labels": True}
RAW = {"preprocessing": {"scaling": "none"}}  # the features as stored


def make_parties(workspace: Path, budget: float | None = 3.0):
    """A registry (id, integer score 0..20) and a clinic (id, three features), aligned."""
    rng = np.random.default_rng(11)
    ids = [f"p{i:04d}" for i in range(ROWS)]
    X = rng.normal(size=(ROWS, 3))
    y = np.clip(np.round(10 + 3 * X[:, 0] - 2 * X[:, 1] + rng.normal(size=ROWS)), 0, 20)
    labels = TableRef(str(workspace / "registry.duckdb"), "outcomes", label_column="y")
    features = TableRef(str(workspace / "clinic.duckdb"), "measurements")
    PartyStore.of(labels).import_frame(pd.DataFrame({"id": ids, "y": y}), labels)
    frame = pd.DataFrame(X, columns=["x0", "x1", "x2"]).assign(id=ids)
    PartyStore.of(features).import_frame(frame, features)
    if budget is not None:
        PrivacyLedger(PartyStore.of(labels)).set_budget(labels.table, budget, 0.0)
    return labels, features, X, y


def run(labels: TableRef, features: TableRef, workspace: Path, **options):
    params = {**OPTIONS, **options}
    return label_dp_regression(
        features.to_dict(), labels.to_dict(), workspace=str(workspace), **params
    )


def messages(workspace: Path) -> list[Path]:
    return sorted((workspace / "runs").glob("*/messages/r*/*__*__*"))


def ledger(labels: TableRef) -> PrivacyLedger:
    return PrivacyLedger(PartyStore.of(labels))


def test_one_release_crosses_is_charged_once_and_trains(workspace: Path) -> None:
    labels, features, X, y = make_parties(workspace)
    result = run(labels, features, workspace, evaluate=True, **RAW)
    assert not result["reused"] and result["rows"] == ROWS

    # the audit: one labels -> features message carries labels, and it is the stored release
    channel = channel_for(result["job_id"], str(workspace))
    records = channel.log()
    assert {(r.sender, r.receiver, r.kind) for r in records} == {
        ("registry", "clinic", "id_order_digest"),
        ("registry", "clinic", "label_dp_terms"),
        ("registry", "clinic", "noisy_labels"),
        ("clinic", "registry", "id_order_digest"),  # unprompted: the release waits for none
        ("clinic", "registry", "predictions"),
    }
    payloads = {r.kind: codec.loads(channel.read_raw(r)) for r in records}
    to_features = [r for r in records if r.sender == "registry"]
    carrying = [r for r in to_features if isinstance(payloads[r.kind], np.ndarray)]
    assert [r.kind for r in carrying] == ["noisy_labels"]
    assert isinstance(payloads["id_order_digest"], str) and len(payloads["id_order_digest"]) == 64
    stored = ledger(labels).stored_release(result["release_key"])
    noisy = payloads["noisy_labels"]
    np.testing.assert_array_equal(noisy, stored["noisy_labels"])
    assert noisy.shape == (ROWS,)
    assert set(np.unique(noisy)) <= set(stored["outputs"])  # only the mechanism's outputs
    assert len(stored["outputs"]) == result["mechanism"]["bins"]
    assert len(payloads["predictions"]) == round(0.2 * ROWS)  # hold-out rows only

    # the features party trained on exactly those labels and saved the model in its own store
    job = steps.LabelDPJob(
        result["job_id"],
        Channel(workspace, result["job_id"]),
        "registry",
        "clinic",
        1.0,
        "squared",
        (0.0, 20.0),
        integer_labels=True,
    )
    train, holdout = job.train_rows(ROWS), job.holdout_rows(ROWS)
    weights, intercept = steps.linear_form(train_on_noisy_labels(X[train], noisy[train], "squared"))
    np.testing.assert_allclose(list(result["coefficients"].values()), weights, rtol=1e-10)
    assert list(result["coefficients"]) == ["x0", "x1", "x2"]
    assert result["intercept"] == pytest.approx(intercept)
    model = ArtifactStore(PartyStore.of(features)).get(result["model_key"])
    assert result["model_key"] == f"models/label_dp/{result['job_id']}"
    assert model["mechanism"]["mechanism"] == "rr_on_bins"
    expected_mse = np.mean((steps.predict(model, X[holdout]) - y[holdout]) ** 2)
    assert result["metrics"]["test_mse"] == pytest.approx(expected_mse)
    key = f"{features.table}-label-dp-{short_id(result['job_id'])}-"  # job named by its table
    summary = Artifact.get(f"{key}summary")
    assert (
        summary is not None
        and "epsilon left" in summary.data
        and "| held-out rows |" in summary.data
    )
    assert Artifact.get(f"{key}model") is not None
    # the held-out calibration is drawn (ten bins, titled with the MSE), not listed as a metric
    [chart] = chart_images(Artifact.get(f"{key}charts").data)
    assert f"MSE {expected_mse:.4g}" in chart and chart.count("<circle") == 10
    assert "calibration" not in result["metrics"]

    # budget: 1.0 of 3.0 spent, once; a re-run (even with the budget now used up) reuses it
    assert result["budget"]["epsilon_spent"] == pytest.approx(1.0)
    ledger(labels).set_budget(labels.table, 1.0, 0.0)
    again = run(labels, features, workspace, evaluate=True, **RAW)
    assert again["reused"] and again["release_key"] == result["release_key"]
    assert again["job_id"] == result["job_id"]
    np.testing.assert_array_equal(codec.loads(channel.read_raw(carrying[0])), noisy)
    with disable_run_logger():  # a retried release task: same labels, nothing charged
        retried = steps.release_noisy_labels.fn(job, labels)
    assert retried["reused"] and retried["budget"]["epsilon_spent"] == pytest.approx(1.0)
    assert len(ledger(labels).spends(labels.table)) == 1

    # over budget: refused before any computation, message or spend (the features party's
    # id-order digest, sent when it starts, says nothing of the labels)
    before = messages(workspace)
    with pytest.raises(BudgetError, match="exceeds the budget"):
        run(labels, features, workspace, epsilon=0.5)
    new = [m.name for m in messages(workspace) if m not in before]
    assert new == ["clinic__registry__id_order_digest"]
    assert len(ledger(labels).spends(labels.table)) == 1


def test_features_are_standardised_on_training_rows_and_the_model_carries_it(
    workspace: Path,
) -> None:
    labels, features, X, _ = make_parties(workspace)
    frame = PartyStore.of(features).read_table(features)
    skewed = features.with_table("skewed")  # x1 in other units: times 1e3, shifted
    PartyStore.of(features).import_frame(frame.assign(x1=frame["x1"] * 1e3 + 5e4), skewed)
    plain = run(labels, features, workspace, evaluate=True)
    scaled = run(labels, skewed, workspace, evaluate=True)
    assert scaled["reused"] and scaled["job_id"] != plain["job_id"]  # one release, two models
    assert scaled["metrics"]["test_mse"] == pytest.approx(plain["metrics"]["test_mse"], rel=1e-6)

    # the stored statistics are the training rows' own, and applied by hand to the raw rows
    # they give the predictions the features party sent for the held-out rows
    model = ArtifactStore(PartyStore.of(features)).get(scaled["model_key"])
    stats = {c["name"]: c for c in model["preprocessing"]["columns"]}
    channel = Channel(workspace, scaled["job_id"])
    job = steps.LabelDPJob(scaled["job_id"], channel, "registry", "clinic", 1.0, "squared", (0, 20))
    train, holdout = job.train_rows(ROWS), job.holdout_rows(ROWS)
    raw = X.copy()
    raw[:, 1] = raw[:, 1] * 1e3 + 5e4
    assert stats["x1"]["center"] == pytest.approx(raw[train, 1].mean())
    assert stats["x1"]["scale"] == pytest.approx(raw[train, 1].std())
    centers = np.array([stats[f]["center"] for f in model["features"]])
    scales = np.array([stats[f]["scale"] for f in model["features"]])
    weights = np.array([model["coefficients"][f] for f in model["features"]])
    by_hand = (raw[holdout] - centers) / scales @ weights + model["intercept"]
    channel = channel_for(scaled["job_id"], str(workspace))
    [sent] = [r for r in channel.log() if r.kind == "predictions"]
    np.testing.assert_allclose(codec.loads(channel.read_raw(sent)), by_hand, rtol=1e-9)


@pytest.mark.parametrize(
    ("mechanism", "loss"),
    [("laplace", "poisson"), ("exponential", "absolute"), ("staircase", "squared")],
)
def test_baselines_run_behind_the_same_flow(workspace: Path, mechanism: str, loss: str) -> None:
    labels, features, *_ = make_parties(workspace)
    prior = 0.3 if mechanism == "staircase" else None  # a baseline may buy a private prior
    result = run(
        labels,
        features,
        workspace,
        mechanism=mechanism,
        loss=loss,
        prior_epsilon=prior,
        evaluate=True,
    )
    summary = result["mechanism"]
    assert summary["mechanism"] == mechanism and summary["bins"] == 21
    assert summary["prior_epsilon"] == pytest.approx(prior or 0.0)
    assert summary["label_epsilon"] == pytest.approx(1.0 - (prior or 0.0))
    stored = ledger(labels).stored_release(result["release_key"])
    assert set(np.unique(stored["noisy_labels"])) <= set(stored["outputs"]) <= set(range(21))
    spends = ledger(labels).spends(labels.table)
    assert [(s["mechanism"], s["epsilon"]) for s in spends] == [(mechanism, 1.0)]
    model = ArtifactStore(PartyStore.of(features)).get(result["model_key"])
    assert model["link"] == ("log" if loss == "poisson" else "identity")
    assert np.isfinite(result["metrics"]["test_mse"])
    if loss != "squared":
        assert np.isfinite(result["metrics"][f"test_{loss}_loss"])


def test_bad_inputs_are_refused_before_any_release(workspace: Path) -> None:
    labels, features, _, y = make_parties(workspace)
    for epsilon in (0.0, -1.0):  # refused by the stage's model, naming the option
        with pytest.raises(ParameterTypeError, match="epsilon: Input should be greater than 0"):
            run(labels, features, workspace, epsilon=epsilon)
    with pytest.raises(InvalidEpsilonError, match=r"prior_epsilon 1\.0 must be smaller"):
        run(labels, features, workspace, prior_epsilon=1.0)
    with pytest.raises(ParameterTypeError, match="mechanism: Input should be 'rr_on_bins'"):
        run(labels, features, workspace, mechanism="gaussian")
    row = int(np.flatnonzero(y > 15)[0]) + 1
    with pytest.raises(
        DataValidationError,
        match=rf"'outcomes', column 'y', row {row} .*"
        r"outside label_range \[0, 15\]",
    ):
        run(labels, features, workspace, label_range=[0, 15], clip=False)
    store = PartyStore.of(labels)
    frame = store.read_table(labels)
    store.write_table("empty", frame.iloc[:0])
    with pytest.raises(DataValidationError, match=r"'empty'.*table is empty"):
        run(labels.with_table("empty"), features, workspace)
    store.write_table("holes", frame.assign(y=np.where(np.arange(ROWS) == 4, np.nan, frame["y"])))
    with pytest.raises(DataValidationError, match=r"'holes', column 'y', row 5 .*missing"):
        run(labels.with_table("holes"), features, workspace)
    store.write_table("unbudgeted", frame)
    with pytest.raises(BudgetError, match="no privacy budget is set"):
        run(labels.with_table("unbudgeted"), features, workspace)
    shuffled = PartyStore.of(features).read_table(features).sample(frac=1.0, random_state=2)
    PartyStore.of(features).import_frame(shuffled, features)
    with pytest.raises(steps.LabelDPSetupError, match="not aligned"):
        run(labels, features, workspace)
    assert ledger(labels).spends() == []
    assert not [m for m in messages(workspace) if m.name.endswith("__noisy_labels")]


def test_demo_job_sets_a_budget_aligns_and_trains(workspace: Path) -> None:
    job = json.loads((ROOT / "jobs" / "label_dp_demo.json").read_text())
    job_file = relocate_job(job, ROOT, workspace)
    parties = pipeline(str(job_file), workspace=str(workspace))  # every side, locally
    labels, features = (
        next(s.result for s in parties[p].stages if s.stage == "label_dp")
        for p in ("registry", "clinic")
    )
    result = {**labels, "coefficients": features["coefficients"]}
    assert result["rows"] == features["rows"] == 442
    assert result["budget"]["epsilon_total"] == 4.0
    assert result["budget"]["epsilon_spent"] == pytest.approx(2.0)
    assert result["metrics"]["evaluated_on"] == "holdout"
    assert np.isfinite(result["metrics"]["test_mse"])
    assert set(result["coefficients"]) == {
        "age",
        "sex",
        "bmi",
        "bp",
        "s1",
        "s2",
        "s3",
        "s4",
        "s5",
        "s6",
    }


def labels_alone(
    workspace: Path, labels: TableRef, features: TableRef, digest_job: str
) -> dict[str, Any]:
    """The labels party's side alone, the features party's id-order digest (made for job
    ``digest_job``) already sent, as the features party sends it when it starts: no other
    message of the features party ever comes."""
    job_id = "label-dp-alone"
    ids = PartyStore.of(features).read_table(features)["id"]
    clinic = Channel(workspace, job_id).endpoint(features.party)
    clinic.send(labels.party, "id_order_digest", id_order_digest(digest_job, ids))
    options = LabelDPOptions(**OPTIONS)
    return label_dp_party(labels.to_dict(), "labels", features.party, job_id, options)


def test_the_labels_party_checks_alignment_itself_before_it_charges(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release waits for no answer of the features party (a round trip): the labels
    party compares the digest sent unprompted; a mismatch is refused before any charge."""
    monkeypatch.setenv("PRIVREG_HOME", str(workspace))
    labels, features, _, _ = make_parties(workspace)
    with pytest.raises(steps.LabelDPSetupError, match="not aligned"):
        labels_alone(workspace, labels, features, "another-job")
    assert ledger(labels).spends() == []
    assert not [m for m in messages(workspace) if m.name.endswith("__noisy_labels")]
    shutil.rmtree(workspace / "runs")
    released = labels_alone(workspace, labels, features, "label-dp-alone")
    assert not released["reused"]
    assert len(ledger(labels).spends()) == 1
    assert [m for m in messages(workspace) if m.name.endswith("__noisy_labels")]
