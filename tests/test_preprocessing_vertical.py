"""Vertical LR on raw features: each party scales its own columns, scoring applies the same
statistics, missing cells are imputed or refused at once, divergence and a model below its
baseline are outcomes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from core.outcomes import BELOW_BASELINE, DivergenceError
from core.preprocessing import PreprocessingSpec
from core.vertical_lr.schedule import Schedule
from flows.scoring import score_vertical
from flows.vertical_lr import vertical_lr
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.validation import MissingValuesError

pytestmark = pytest.mark.usefixtures("prefect_server")
DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "fate"
ROWS, BATCH, SEED, HOLDOUT = 300, 135, 3, 0.1
OPTIONS = {
    "epochs": 3,
    "batch_size": BATCH,
    "learning_rate": 0.15,
    "momentum": 0.9,
    "l2": 0.01,
    "seed": SEED,
    "key_size": 1024,
    "tol": 0.0,
    "holdout_fraction": HOLDOUT,
}
SCALE = np.array([1e3, 3e3, 0.5e3, 2e3, 1e3, 4e3, 1e3, 2.5e3, 1e3, 1e3])  # raw units


def breast() -> tuple[pd.DataFrame, pd.DataFrame]:
    guest = pd.read_csv(DATA / "breast_hetero_guest.csv.gz")
    host = pd.read_csv(DATA / "breast_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    return guest, host.reset_index()


def raw(frame: pd.DataFrame) -> pd.DataFrame:
    """The same table in raw units: every feature multiplied by a thousand or so, shifted."""
    out = frame.copy()
    columns = [c for c in frame.columns if c.startswith("x")]
    for j, column in enumerate(columns):
        out[column] = frame[column] * SCALE[j % len(SCALE)] + 5e3 * (j + 1)
    return out


def store(workspace: Path, name: str, guest: pd.DataFrame, host: pd.DataFrame):
    guest_ref = TableRef(str(workspace / f"{name}_guest.duckdb"), "patients", label_column="y",
                         label_domain=(0, 1), party="clinic")  # fmt: skip
    host_ref = TableRef(str(workspace / f"{name}_host.duckdb"), "labs", party="lab")
    PartyStore.of(guest_ref).import_frame(guest, guest_ref)
    PartyStore.of(host_ref).import_frame(host, host_ref)
    return guest_ref, host_ref


def train(workspace: Path, guest_ref: TableRef, host_ref: TableRef, **options):
    return vertical_lr(
        guest_ref.to_dict(), [host_ref.to_dict()], workspace=str(workspace), **OPTIONS | options
    )


def test_raw_features_train_as_standardised_ones_and_score_by_hand(workspace: Path) -> None:
    guest, host = breast()
    train_guest, train_host = guest.head(ROWS), host.head(ROWS)
    standard = train(workspace, *store(workspace, "std", train_guest, train_host))
    refs = store(workspace, "raw", raw(train_guest), raw(train_host))
    result = train(workspace, *refs)
    assert standard["metrics"]["holdout_auc"] > 0.9
    assert abs(result["metrics"]["holdout_auc"] - standard["metrics"]["holdout_auc"]) <= 0.005
    assert result["outcome"] == "trained"

    # new raw rows, scored with the stored statistics; the same model applied by hand
    new_guest, new_host = raw(guest.iloc[ROWS:]), raw(host.iloc[ROWS:])
    new_guest_ref = TableRef(refs[0].database, "new_patients", label_column="y",
                             label_domain=(0, 1), party="clinic")  # fmt: skip
    new_host_ref = TableRef(refs[1].database, "new_labs", party="lab")
    PartyStore.of(new_guest_ref).import_frame(new_guest, new_guest_ref)
    PartyStore.of(new_host_ref).import_frame(new_host, new_host_ref)
    scored = score_vertical(
        new_guest_ref.to_dict(),
        [new_host_ref.to_dict()],
        model_job_id=result["job_id"],
        workspace=str(workspace),
    )
    by_hand = np.zeros(len(new_guest))
    for ref, frame in ((refs[0], new_guest), (refs[1], new_host)):
        model = ArtifactStore(PartyStore.of(ref)).get(
            f"models/vertical/{result['job_id']}/{ref.party}"
        )
        stats = model["preprocessing"]["columns"]
        X = frame[[c["name"] for c in stats]].to_numpy(dtype=float)
        X = (X - [c["center"] for c in stats]) / [c["scale"] for c in stats]
        head = [model["intercept"]] if ref.party == "clinic" else []
        weights = np.asarray([*head, *model["coefficients"].values()])
        if ref.party == "clinic":  # the intercept first
            X = np.hstack([np.ones((len(X), 1)), X])
        by_hand += X @ weights
    with PartyStore.of(new_guest_ref).connect() as con:
        table = con.execute(f'SELECT * FROM "{scored["scores_table"]}"').df()
    got = dict(zip(table["id"].astype(int), table["score"], strict=True))
    np.testing.assert_allclose([got[int(i)] for i in new_guest["id"]], by_hand, atol=1e-9)
    assert scored["auc"] == pytest.approx(roc_auc_score(new_guest["y"], by_hand))


def test_missing_cells_are_refused_at_once_or_imputed(workspace: Path) -> None:
    guest, host = breast()
    guest, host = raw(guest.head(ROWS)), raw(host.head(ROWS))
    guest = guest.astype({"x1": object, "x4": object})
    guest.loc[[3, 50, 77], "x1"] = np.nan
    guest.loc[[10, 11], "x4"] = "?"  # a disguised missing value
    host.loc[[5, 6, 7, 8], "x2"] = 0.0  # e.g. a cholesterol of 0
    guest_ref = TableRef(str(workspace / "clinic.duckdb"), "patients", label_column="y",
                         label_domain=(0, 1), party="clinic")  # fmt: skip
    host_ref = TableRef(str(workspace / "lab.duckdb"), "labs", party="lab")
    store_ = PartyStore.of(guest_ref)
    spec = PreprocessingSpec.from_dict({"missing_values": {"*": ["?"]}})
    with pytest.raises(MissingValuesError) as refused:  # every column at once, and the option
        store_.import_frame(guest, guest_ref, spec)
    message = str(refused.value)
    assert "column 'x1': 3 of 300 rows (first row 4)" in message
    assert "column 'x4': 2 of 300 rows (first row 11)" in message
    assert "preprocessing.impute" in message
    job = {"impute": "median", "missing_indicator": True, "missing_values": {"*": ["?"]}}
    store_.import_frame(guest, guest_ref, PreprocessingSpec.from_dict(job))
    lab = PreprocessingSpec.from_dict(job).with_party({"missing_values": {"x2": [0]}})
    PartyStore.of(host_ref).import_frame(host, host_ref, lab)
    result = train(workspace, guest_ref, host_ref, preprocessing=job, epochs=1)
    assert "x1_missing" in result["coefficients"] and "x4_missing" in result["coefficients"]
    host_model = ArtifactStore(PartyStore.of(host_ref)).get(
        f"models/vertical/{result['job_id']}/lab"
    )
    x2 = next(c for c in host_model["preprocessing"]["columns"] if c["name"] == "x2")
    observed = np.delete(host["x2"].to_numpy(dtype=float), [5, 6, 7, 8])
    assert x2["missing"] == 4 and x2["fill"] == pytest.approx(np.median(observed))
    assert "x2_missing" in host_model["features"]
    assert result["metrics"]["holdout_auc"] > 0.9


def test_a_diverging_run_fails_naming_the_round(workspace: Path) -> None:
    guest, host = breast()
    refs = store(workspace, "raw", raw(guest.head(ROWS)), raw(host.head(ROWS)))
    state = vertical_lr(
        refs[0].to_dict(),
        [refs[1].to_dict()],
        workspace=str(workspace),
        preprocessing={"scaling": "none"},
        return_state=True,
        **OPTIONS,
    )
    assert state.is_failed()
    with pytest.raises(DivergenceError, match=r"diverged in round \d+.*learning_rate.*scaling"):
        state.result()


def test_a_model_below_its_baseline_ends_in_a_named_state(workspace: Path) -> None:
    guest, host = breast()
    guest, host = guest.head(ROWS).copy(), host.head(ROWS)
    held_out = Schedule(ROWS, BATCH, SEED, HOLDOUT).holdout_rows
    guest.loc[held_out, "y"] = 1 - guest.loc[held_out, "y"]  # the held-out rows say the opposite
    refs = store(workspace, "flipped", guest, host)
    state = train(workspace, *refs, epochs=1, return_state=True)
    assert state.is_completed() and state.name == BELOW_BASELINE
    result = state.result()  # still the flow's dictionary
    assert result["metrics"]["holdout_auc"] < 0.5
    assert result["outcome"].startswith(BELOW_BASELINE)
