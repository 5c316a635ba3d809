"""WALR flow: the encrypted one-shot sum is exact, the release is charged once, nothing leaks."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest
from helpers import FetchLog, summary_quality
from prefect.artifacts import Artifact
from prefect.exceptions import ParameterTypeError
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss, roc_auc_score

from core.dp.accounting import ApproximateDP, Charge, composed_epsilon, event_from_dict
from core.paillier.errors import KeySizeError
from core.test_switches import NOISELESS_VARIABLE, SMALL_KEYS_VARIABLE
from core.walr import (
    PrivacyWarning,
    WalrFit,
    WalrInputError,
    label_weighted_sum,
    prepare_binary_features,
    prepare_clipped_features,
)
from federation.channel import Channel
from federation.workspace import channel_for
from flows.walr import walr
from storage import codec
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import BudgetError, PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from tasks.reporting import short_id
from tasks.summaries import holdout_split
from tasks.walr import (
    FeaturesFacts,
    ReleaseRefusalError,
    WalrJob,
    WalrSetupError,
    receive_features_facts,
)

pytestmark = pytest.mark.usefixtures("prefect_server")
DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "fate"
ROWS, CLIP, L2 = 300, 5.0, 0.01
FAST = {"key_size": 1024, "l2": L2}


def no_noise(monkeypatch: pytest.MonkeyPatch, *job_ids: str) -> dict[str, Any]:
    """Options of exact releases for ``job_ids`` (the first, unless another is passed), which
    the test switch of this process names: nothing else can confirm ``noise=False``."""
    monkeypatch.setenv(NOISELESS_VARIABLE, ",".join(job_ids))
    return {"noise": False, "job_id": job_ids[0]}


def parties(workspace: Path, binary: bool = False, budget: tuple[float, float] = (10.0, 1e-3)):
    """Advertiser (labels y of breast's guest) and publisher (breast's 20 host features)."""
    guest = pd.read_csv(DATA / "breast_hetero_guest.csv.gz").head(ROWS)
    host = pd.read_csv(DATA / "breast_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    if binary:
        host = (host > 0).astype(float)
    labels = TableRef(
        database=str(workspace / "advertiser.duckdb"),
        table="conversions",
        label_column="y",
        label_domain=(0, 1),
    )
    features = TableRef(database=str(workspace / "publisher.duckdb"), table="impressions")
    PartyStore.of(labels).import_frame(guest, labels)
    PartyStore.of(features).import_frame(host.reset_index(), features)
    PrivacyLedger(PartyStore.of(labels)).set_budget("conversions", *budget)
    return features, labels, host.to_numpy(), guest["y"].to_numpy()


def run(features: TableRef, labels: TableRef, workspace: Path, **options: Any) -> dict[str, Any]:
    settings = {
        "epsilon": 1.0,
        "delta": 1e-4,
        "mode": "clipped",
        "clip_norm": CLIP,
        "preprocessing": {"scaling": "none"},  # the stored features (None: standardise)
        **FAST,
        **options,
    }
    return walr(features.to_dict(), labels.to_dict(), workspace=str(workspace), **settings)


def ints_in(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [i for v in value.values() for i in ints_in(v)]
    if isinstance(value, list):
        return [i for v in value for i in ints_in(v)]
    return []


def messages(workspace: Path, sender: str = "advertiser") -> list[Path]:
    """What ``sender`` (the labels party, which refuses) sent: nothing, when it refuses; the
    features party's public facts may have gone out meanwhile (both sides run at once)."""
    return list((workspace / "runs").glob(f"*/messages/*/{sender}__*"))


@pytest.mark.parametrize("mode", ["binary", "clipped"])
def test_noiseless_release_is_the_exact_sum_and_the_fit_matches_sklearn(
    workspace: Path, mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    features, labels, X, y = parties(workspace, binary=mode == "binary")
    OwnerPolicy(PartyStore.of(labels)).set("conversions", allow_noiseless_release=True)
    clip = {"clip_norm": CLIP if mode == "clipped" else None}
    with caplog.at_level(logging.WARNING):
        result = run(
            features, labels, workspace, mode=mode, **clip, **no_noise(monkeypatch, "walr-exact")
        )
    assert any(
        "NOT private" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )
    prepared = prepare_binary_features(X) if mode == "binary" else prepare_clipped_features(X, CLIP)
    exact = label_weighted_sum(prepared, y)
    np.testing.assert_array_equal(result["noisy_sum"], exact)
    # the labels party's stored (decrypted, masked) release minus the publisher's mask: exact
    release_keys = [k for k, *_ in ArtifactStore(PartyStore.of(labels)).list("release/")]
    release = ArtifactStore(PartyStore.of(labels)).get(release_keys[0])
    mask = ArtifactStore(PartyStore.of(features)).get(
        f"walr/{result['job_id']}/mask/{release['mask_id']}"
    )
    unmasked = [v - m for v, m in zip(release["values"], mask, strict=True)]
    assert unmasked == (y @ prepared.grid_units()).tolist()
    assert min(release["values"]) > 2**120  # what the labels party saw was masked

    reference = LogisticRegression(C=1.0 / (ROWS * L2), tol=1e-12, max_iter=10_000)
    reference.fit(prepared.values, y)
    assert result["converged"]
    np.testing.assert_allclose(list(result["coefficients"].values()), reference.coef_[0], atol=1e-4)
    assert result["intercept"] == pytest.approx(reference.intercept_[0], abs=1e-4)
    model = ArtifactStore(PartyStore.of(features)).get(result["model_key"])
    assert model["features"] == [f"x{j}" for j in range(20)]


def test_rerun_reuses_the_release_and_only_ciphertexts_carry_labels(workspace: Path) -> None:
    features, labels, X, y = parties(workspace, budget=(1.0, 1e-4))  # room for one release only
    first = run(features, labels, workspace)
    exact = label_weighted_sum(prepare_clipped_features(X, CLIP), y)
    noise = (np.array(first["noisy_sum"]) - exact) / first["granularity"]
    assert np.any(noise != 0) and np.array_equal(noise, np.rint(noise))  # on the grid

    channel = channel_for(first["job_id"], str(workspace))
    records = channel.log()
    assert {(r.sender, r.receiver, r.kind) for r in records} == {
        ("publisher", "advertiser", "id_order_digest"),
        ("publisher", "advertiser", "walr_features"),
        ("advertiser", "publisher", "walr_plan"),
        ("advertiser", "publisher", "walr_public_key"),
        ("advertiser", "publisher", "walr_encrypted_labels"),
        ("publisher", "advertiser", "walr_masked_sums"),
        ("advertiser", "publisher", "walr_release"),
    }
    for record in records:
        found = ints_in(codec.loads(channel.read_raw(record)))
        if record.kind in ("id_order_digest", "walr_plan"):
            assert found == []  # a digest; whether a new release is made
            continue
        if record.kind == "walr_features":
            assert found == [20]  # the public column count
            continue
        if record.kind in ("walr_public_key", "walr_release"):
            assert found and all(v > 2**120 for v in found)  # a key; sums under 256-bit masks
        else:  # [[y]] and [[X^T y + r]]: Paillier ciphertexts only
            assert found and all(c.bit_length() > 1500 for c in found), record.kind
        if record.receiver == "publisher":  # never a label, a count or an unmasked sum
            assert found and all(v > 2**120 for v in found), record.kind
    encrypted = codec.loads(
        channel.read_raw(next(r for r in records if r.kind == "walr_encrypted_labels"))
    )
    assert len(encrypted) == ROWS

    second = run(features, labels, workspace)
    third = run(features, labels, workspace, l2=0.05)  # another job, same release
    assert second["reused_release"] and third["reused_release"]
    assert second["job_id"] == first["job_id"] != third["job_id"]
    assert third["release_job_id"] == first["job_id"]
    assert second["noisy_sum"] == first["noisy_sum"] == third["noisy_sum"]
    assert second["coefficients"] == first["coefficients"] != third["coefficients"]
    ledger = PrivacyLedger(PartyStore.of(labels))
    [spend] = ledger.spends("conversions")  # charged once
    event = event_from_dict(json.loads(spend["event"]))  # the discrete Gaussian release
    one = composed_epsilon([Charge(event, 1.0, spend["delta"])], 1e-4)
    assert event.mechanism == "discrete_gaussian" and one <= 1.0
    assert ledger.status("conversions").epsilon_spent == pytest.approx(one)
    assert third["budget"]["epsilon_left"] == pytest.approx(1.0 - one)


def test_over_budget_is_refused_before_any_message(workspace: Path) -> None:
    features, labels, *_ = parties(workspace, budget=(0.5, 1e-4))
    with pytest.raises(BudgetError, match="exceeds the budget"):
        run(features, labels, workspace)
    assert messages(workspace) == []
    assert PrivacyLedger(PartyStore.of(labels)).spends() == []
    with pytest.raises(ReleaseRefusalError, match="refusing protected_table='other_table'"):
        run(features, labels, workspace, protected_table="other_table")
    assert messages(workspace) == []


def test_bad_inputs_are_refused_with_clear_errors(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    features, labels, *_ = parties(workspace)
    with pytest.raises(WalrInputError, match=r"column 'x0', row 1: .* is not binary"):
        run(features, labels, workspace, mode="binary", clip_norm=None)
    bad = PartyStore.of(labels).read_table(labels)
    bad.loc[4, "y"] = 2.0
    bad_labels = TableRef(database=labels.database, table="bad", label_column="y")
    PartyStore.of(bad_labels).import_frame(bad, bad_labels)
    PrivacyLedger(PartyStore.of(labels)).set_budget("bad", 10.0, 1e-3)
    with pytest.raises(WalrInputError, match=r"label, row 5: value 2.0 is not 0 or 1"):
        run(features, bad_labels, workspace)
    for epsilon, delta, problem in (
        (0.0, 1e-4, "epsilon"),
        (-1.0, 1e-4, "epsilon"),
        (1.0, 0.0, "delta"),
        (1.0, 1.0, "delta"),
    ):
        with pytest.raises(ParameterTypeError, match=f"{problem}: Input should be"):
            run(features, labels, workspace, epsilon=epsilon, delta=delta)
    with pytest.raises(WalrSetupError, match=f"{NOISELESS_VARIABLE}=walr-unsure"):
        run(features, labels, workspace, noise=False, job_id="walr-unsure")
    monkeypatch.setenv(NOISELESS_VARIABLE, "walr-other")  # a switch for another job only
    with pytest.raises(WalrSetupError, match="no privacy"):
        run(features, labels, workspace, noise=False, job_id="walr-unsure")
    monkeypatch.delenv(NOISELESS_VARIABLE)
    with monkeypatch.context() as without_opt_in:  # a process that did not opt in
        without_opt_in.delenv(SMALL_KEYS_VARIABLE)
        with pytest.raises(KeySizeError, match="below 2048 bits"):
            run(features, labels, workspace)
    with pytest.raises(WalrSetupError, match="needs clip_norm"):
        run(features, labels, workspace, clip_norm=None)
    assert messages(workspace) == []
    shuffled = PartyStore.of(features).read_table(features).sample(frac=1.0, random_state=1)
    PartyStore.of(features).import_frame(shuffled, features)
    with pytest.raises(WalrSetupError, match="not aligned"):
        run(features, labels, workspace)
    assert PrivacyLedger(PartyStore.of(labels)).spends() == []


def test_large_delta_warns_and_evaluation_reveals_only_predictions(workspace: Path) -> None:
    features, labels, *_ = parties(workspace, budget=(10.0, 0.05))
    with pytest.warns(PrivacyWarning, match="not below 1/N"):
        result = run(features, labels, workspace, epsilon=4.0, delta=0.01, evaluate=True)
    assert result["metrics"]["auc"] > 0.9
    assert result["sigma_classic"] is None  # the textbook formula does not hold above eps 1
    assert result["sigma"] > 0 and result["sigma_analytic_continuous"] > 0
    records = channel_for(result["job_id"], str(workspace)).log()
    assert [r.sender for r in records if r.kind == "predictions"] == ["publisher"]


def test_held_out_rows_stay_out_of_the_release_and_are_scored_for_the_summary(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    features, labels, X, y = parties(workspace)
    OwnerPolicy(PartyStore.of(labels)).set("conversions", allow_noiseless_release=True)
    exact = no_noise(monkeypatch, "walr-held-out")
    result = run(features, labels, workspace, holdout_fraction=0.2, **exact)
    train, held_out = holdout_split(ROWS, 0.2, "walr")
    assert len(held_out) == 60 and len(np.intersect1d(train, held_out)) == 0
    # the release is the plaintext label-weighted sum over the training rows only
    prepared = prepare_clipped_features(X, CLIP)
    exact = label_weighted_sum(prepare_clipped_features(X[train], CLIP), y[train])
    np.testing.assert_array_equal(result["noisy_sum"], exact)
    nominal = ApproximateDP(1.0, result["delta"])  # a release without noise: only its pair
    charged = composed_epsilon([Charge(nominal, 1.0, result["delta"])], 1e-3)
    assert result["epsilon"] == 1.0 and result["budget"]["epsilon_spent"] == pytest.approx(charged)
    channel = channel_for(result["job_id"], str(workspace))
    sent = {r.kind: codec.loads(channel.read_raw(r)) for r in channel.log()}
    assert len(sent["walr_encrypted_labels"]) == 240 and len(sent["predictions"]) == 60

    # the labels party scored the held-out rows only; the summary holds the same figures
    fit = WalrFit(np.array(list(result["coefficients"].values())), result["intercept"], True, 0)
    scores = fit.predict_proba(prepared.values[held_out])
    rate = np.full(60, y[train].mean())
    expected = {
        "AUC": (roc_auc_score(y[held_out], scores), 0.5),
        "log-loss": (log_loss(y[held_out], scores), log_loss(y[held_out], rate)),
    }
    quality = summary_quality(f"impressions-walr-{short_id(result['job_id'])}-summary")
    for metric, (model, baseline) in expected.items():
        assert quality[metric][0] == pytest.approx(model, rel=1e-5)
        assert quality[metric][1] == pytest.approx(baseline, rel=1e-5)
        assert quality[metric][2] == "60 held-out rows"
    assert result["metrics"]["log_loss"] == pytest.approx(expected["log-loss"][0])
    # one summary per run: the release's public figures are rows of it, no artifact of their own
    summary = Artifact.get(f"impressions-walr-{short_id(result['job_id'])}-summary").data
    assert f"| most one row can move the sum (L2 sensitivity) | {result['sensitivity']:.6g} |" in (
        summary
    )
    assert "| rows in the sum (public, N) | 240, 60 held out |" in summary
    assert Artifact.get(f"impressions-walr-{short_id(result['job_id'])}-release") is None


def test_standardised_by_default_on_training_rows_and_the_model_carries_it(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    features, labels, X, _ = parties(workspace, budget=(10.0, 1e-2))
    OwnerPolicy(PartyStore.of(labels)).set("conversions", allow_noiseless_release=True)
    frame = PartyStore.of(features).read_table(features)
    skewed = features.with_table("skewed")  # x0 in other units: times 1e3, shifted
    PartyStore.of(features).import_frame(frame.assign(x0=frame["x0"] * 1e3 + 5e4), skewed)
    options = {"holdout_fraction": 0.2, "preprocessing": None}
    exact = no_noise(monkeypatch, "walr-plain", "walr-scaled")
    plain = run(features, labels, workspace, **options, **exact)
    scaled = run(skewed, labels, workspace, **options, **{**exact, "job_id": "walr-scaled"})
    assert not scaled["reused_release"]  # other features: another sum
    for metric in ("auc", "log_loss"):
        assert scaled["metrics"][metric] == pytest.approx(plain["metrics"][metric], abs=1e-3)
    assert scaled["metrics"]["auc"] > 0.9

    # the stored statistics are the training rows' own; applied by hand to the raw rows (then
    # clipped as in training) they give the scores the features party sent
    model = ArtifactStore(PartyStore.of(features)).get(scaled["model_key"])
    stats = {c["name"]: c for c in model["preprocessing"]["columns"]}
    train, held_out = holdout_split(ROWS, 0.2, "walr")
    raw = X.copy()
    raw[:, 0] = raw[:, 0] * 1e3 + 5e4
    assert stats["x0"]["center"] == pytest.approx(raw[train, 0].mean())
    assert stats["x0"]["scale"] == pytest.approx(raw[train, 0].std())
    centers = np.array([stats[f]["center"] for f in model["features"]])
    scales = np.array([stats[f]["scale"] for f in model["features"]])
    prepared = prepare_clipped_features((raw - centers) / scales, CLIP)
    weights = np.array([model["coefficients"][f] for f in model["features"]])
    by_hand = WalrFit(weights, model["intercept"], True, 0).predict_proba(prepared.values)
    channel = channel_for(scaled["job_id"], str(workspace))
    [sent] = [r for r in channel.log() if r.kind == "predictions"]
    np.testing.assert_allclose(codec.loads(channel.read_raw(sent)), by_hand[held_out], rtol=1e-9)


def test_the_id_order_digest_is_fetched_with_the_features_facts(tmp_path: Path) -> None:
    """The digest the features party sends with its facts is asked for beside them, not a
    round trip after the labels and budget check, when the alignment check reads it."""
    log = FetchLog(tmp_path, "advertiser")
    job = WalrJob(
        "walr-prefetch", Channel(tmp_path, "walr-prefetch", log, timeout=5.0), "publisher",
        "advertiser", 1.0, 1e-5, "binary", None, "labels", "", "",
    )  # fmt: skip
    publisher = Channel(tmp_path, "walr-prefetch").endpoint("publisher")
    publisher.send("advertiser", "id_order_digest", "digest")
    facts = FeaturesFacts(3, "binary", None, "f").as_message()
    publisher.send("advertiser", "walr_features", facts)
    taken = receive_features_facts.fn(job, SimpleNamespace(party="advertiser"))
    assert taken == {"columns": 3, "features_fingerprint": "f"}
    deadline = time.monotonic() + 5.0
    while "id_order_digest" not in log.asked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(log.asked) == ["id_order_digest", "walr_features"]


@pytest.mark.parametrize(
    "message",
    [
        {"columns": 3, "mode": "binary", "clip_norm": None},  # no fingerprint
        {"columns": 3, "mode": "binary", "clip_norm": None, "fingerprint": "f", "rows": 9},
        ["columns", 3],
        {"columns": True, "mode": "binary", "clip_norm": None, "fingerprint": "f"},
    ],
)
def test_unreadable_features_facts_are_refused_naming_the_sender(message: object) -> None:
    with pytest.raises(WalrSetupError, match="publisher"):
        FeaturesFacts.from_message(message, "publisher")


def test_features_facts_round_trip_and_default_the_hold_out() -> None:
    facts = FeaturesFacts(3, "clipped", 2.0, "f", 0.25)
    assert FeaturesFacts.from_message(facts.as_message(), "publisher") == facts
    old = {"columns": 3, "mode": "binary", "clip_norm": None, "fingerprint": "f"}
    assert FeaturesFacts.from_message(old, "publisher").holdout_fraction == 0.0
