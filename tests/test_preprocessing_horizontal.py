"""Horizontal LR on raw features: pooled statistics from secure sums scale and impute every
hospital alike, travel with the model into scoring; divergence and a model below its
baseline are outcomes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from core.outcomes import BELOW_BASELINE, DivergenceError
from core.preprocessing import FittedPreprocessing, PreprocessingSpec
from flows.horizontal_lr import horizontal_lr, predict_proba
from flows.scoring import score_local
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import horizontal_lr as steps
from tasks.summaries import holdout_split

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
OPTIONS: dict[str, Any] = {"learning_rate": 0.5, "l2": 1e-3, "tol": 0.0, "rounds": 12}


def demo(name: str) -> pd.DataFrame:
    return pd.read_csv(ROOT / "demo" / "horizontal" / f"{name}.csv")


def raw(frame: pd.DataFrame) -> pd.DataFrame:
    """The same rows in raw units: features multiplied by about a thousand and shifted."""
    out = frame.copy()
    for j, column in enumerate(frame.columns[2:]):
        out[column] = frame[column] * (1e3 * (1 + j % 4)) + 5e3 * (j + 1)
    return out


def load(workspace: Path, frames: dict[str, pd.DataFrame], spec: Any = None) -> list[TableRef]:
    refs = []
    for name, frame in frames.items():
        ref = TableRef(str(workspace / f"{name}.duckdb"), "patients", id_column="patient_id",
                       label_column="diagnosis", label_domain=(0, 1), party=name)  # fmt: skip
        PartyStore.of(ref).import_frame(frame, ref, spec)
        refs.append(ref)
    return refs


def run(refs: list[TableRef], workspace: Path, **options: Any) -> Any:
    return horizontal_lr([r.to_dict() for r in refs], workspace=str(workspace), **OPTIONS | options)


def held_out_auc(result: dict[str, Any], frames: dict[str, pd.DataFrame], fraction: float) -> float:
    scores, labels = [], []
    for frame in frames.values():
        held = holdout_split(len(frame), fraction, result["job_id"])[1]
        scores.append(predict_proba(result, frame.iloc[held]))  # raw values, model's transform
        labels.append(frame["diagnosis"].to_numpy()[held])
    return float(roc_auc_score(np.concatenate(labels), np.concatenate(scores)))


def test_raw_features_train_as_standardised_ones_and_score_by_hand(workspace: Path) -> None:
    frames = {h: demo(h) for h in HOSPITALS}
    raw_frames = {h: raw(f) for h, f in frames.items()}
    same = {"holdout_fraction": 0.2, "job_id": "hlr-units"}  # the same held-out rows
    standard = run(load(workspace / "std", frames), workspace / "std", **same)
    refs = load(workspace / "raw", raw_frames)
    result = run(refs, workspace / "raw", **same)
    auc = held_out_auc(result, raw_frames, 0.2)
    assert held_out_auc(standard, frames, 0.2) > 0.95
    assert abs(auc - held_out_auc(standard, frames, 0.2)) <= 0.005
    assert result["outcome"] == "trained"

    # the coordinator's statistics are the pooled training rows' mean and deviation
    pooled = pd.concat(
        f.iloc[holdout_split(len(f), 0.2, result["job_id"])[0]] for f in raw_frames.values()
    )
    stats = {c["name"]: c for c in result["preprocessing"]["columns"]}
    for column in list(pooled.columns[2:])[:5]:
        assert stats[column]["center"] == pytest.approx(pooled[column].mean(), rel=1e-9)
        assert stats[column]["scale"] == pytest.approx(pooled[column].std(ddof=0), rel=1e-6)

    # new raw rows at hospital_a, scored with the model it keeps; the same model by hand
    new = raw_frames["hospital_a"].head(40).assign(patient_id=lambda f: f["patient_id"] + 10**6)
    new_ref = TableRef(refs[0].database, "new_patients", id_column="patient_id",
                       label_column="diagnosis", party="hospital_a")  # fmt: skip
    PartyStore.of(new_ref).import_frame(new, new_ref)
    scored = score_local(new_ref.to_dict(), steps.model_key(result["job_id"]))
    columns = result["preprocessing"]["columns"]
    X = new[[c["name"] for c in columns]].to_numpy(dtype=float)
    X = (X - [c["center"] for c in columns]) / [c["scale"] for c in columns]
    by_hand = X @ np.array([result["coefficients"][c["name"]] for c in columns])
    by_hand += result["intercept"]
    with PartyStore.of(new_ref).connect() as con:
        table = con.execute(f'SELECT * FROM "{scored["scores_table"]}"').df()
    np.testing.assert_allclose(table["score"].to_numpy(), by_hand, atol=1e-9)


def test_pooled_imputation_equals_the_pooled_statistics_in_the_clear(workspace: Path) -> None:
    rng = np.random.default_rng(11)
    frames = {h: raw(demo(h)).astype(object) for h in HOSPITALS}
    columns = list(frames["hospital_a"].columns[2:5])
    for frame in frames.values():
        for column in columns:
            frame.loc[rng.choice(len(frame), 9, replace=False), column] = np.nan
    frames["hospital_b"].loc[[0, 1, 2], columns[0]] = 0  # a disguised missing value
    truth = pd.concat(frames.values())[columns].astype(float)
    truth.loc[truth[columns[0]] == 0, columns[0]] = np.nan
    job = {"impute": "median", "scaling": "standard"}
    spec = PreprocessingSpec.from_dict(job)
    refs = load(workspace, {h: f for h, f in frames.items() if h != "hospital_b"}, spec)
    own = spec.with_party({"missing_values": {columns[0]: [0]}})  # hospital_b's own declaration
    refs += load(workspace, {"hospital_b": frames["hospital_b"]}, own)
    result = run(refs, workspace, rounds=3, preprocessing=job)
    fitted = FittedPreprocessing.from_dict(result["preprocessing"])
    assert fitted.rows == sum(len(f) for f in frames.values())
    for stats in fitted.columns[:3]:
        observed = np.sort(truth[stats.name].dropna().to_numpy())
        assert stats.missing == int(truth[stats.name].isna().sum())
        assert stats.center == pytest.approx(observed.mean(), rel=1e-9)
        half = len(observed) // 2  # the median, to one bin of the public grid
        width = 16 * stats.scale / 1024
        assert observed[half - 1] - width <= stats.fill <= observed[half] + width
    with pytest.raises(Exception, match=r"missing.*preprocessing\.impute"):
        run(refs, workspace / "refused", rounds=1, preprocessing={"impute": "none"})


def test_a_diverging_run_fails_naming_the_round(workspace: Path) -> None:
    frames = {h: demo(h) for h in HOSPITALS}
    for frame in frames.values():
        frame[frame.columns[2:]] = frame[frame.columns[2:]] * 6.0 + 3.0
    refs = load(workspace, frames)
    state = run(refs, workspace, preprocessing={"scaling": "none"}, return_state=True)
    assert state.is_failed()
    with pytest.raises(DivergenceError, match=r"diverged in round \d+.*learning_rate"):
        state.result()


def test_a_model_below_its_baseline_ends_in_a_named_state(workspace: Path) -> None:
    frames = {h: demo(h) for h in HOSPITALS}
    for frame in frames.values():  # the held-out rows say the opposite of the training rows
        held = holdout_split(len(frame), 0.2, "hlr-flipped")[1]
        frame.loc[held, "diagnosis"] = 1 - frame.loc[held, "diagnosis"]
    refs = load(workspace, frames)
    state = run(refs, workspace, rounds=4, holdout_fraction=0.2, job_id="hlr-flipped",
                return_state=True)  # fmt: skip
    assert state.is_completed() and state.name == BELOW_BASELINE
    assert state.result()["outcome"].startswith(BELOW_BASELINE)


def test_missing_indicators_widen_every_hospitals_model_alike(workspace: Path) -> None:
    """``missing_indicator`` with pooled statistics: a ``<name>_missing`` column for each
    column with gaps anywhere in the pooled rows, the same at every hospital; the model has a
    coefficient for each, and scoring new rows with gaps equals the transform and model by hand."""
    rng = np.random.default_rng(5)
    frames = {h: raw(demo(h)).astype(object) for h in HOSPITALS}
    gappy = list(frames["hospital_a"].columns[2:4])
    frames["hospital_c"].loc[rng.choice(len(frames["hospital_c"]), 12, replace=False), gappy[0]] = (
        np.nan
    )  # gaps at one hospital only: every hospital still gets the indicator
    frames["hospital_a"].loc[rng.choice(len(frames["hospital_a"]), 7, replace=False), gappy[1]] = (
        np.nan
    )
    job = {"impute": "mean", "scaling": "standard", "missing_indicator": True}
    refs = load(workspace, frames, PreprocessingSpec.from_dict(job))
    result = run(refs, workspace, rounds=3, preprocessing=job)
    indicators = [f"{c}_missing" for c in gappy]
    assert result["features"][-2:] == indicators
    assert set(indicators) <= set(result["coefficients"])
    features = list(frames["hospital_a"].columns[2:]) + indicators

    # hospital_b (no gaps of its own) scores with its own copy of the model: the same columns
    new = frames["hospital_b"].head(30).assign(patient_id=lambda f: f["patient_id"] + 10**6)
    new.loc[[0, 3, 4], gappy[0]] = np.nan
    new_ref = TableRef(refs[1].database, "new_patients", id_column="patient_id",
                       label_column="diagnosis", party="hospital_b")  # fmt: skip
    PartyStore.of(new_ref).import_frame(new, new_ref, PreprocessingSpec.from_dict(job))
    scored = score_local(new_ref.to_dict(), steps.model_key(result["job_id"]))
    fitted = FittedPreprocessing.from_dict(result["preprocessing"])
    X = fitted.transform(new[fitted.input_names].to_numpy(dtype=float))
    assert X.shape[1] == len(features) and set(X[:, -2]) == {0.0, 1.0}
    weights = [result["coefficients"][name] for name in fitted.output_names]
    by_hand = X @ np.array(weights) + result["intercept"]
    with PartyStore.of(new_ref).connect() as con:
        table = con.execute(f'SELECT * FROM "{scored["scores_table"]}"').df()
    np.testing.assert_allclose(table["score"].to_numpy(), by_hand, atol=1e-9)
