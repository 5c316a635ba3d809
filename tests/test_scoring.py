"""Scoring flows: a stored model applied to new rows equals the plaintext model on them."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from flows.scoring import score_local, score_vertical
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.workspace import channel_for
from tasks.horizontal_lr import model_record

pytestmark = pytest.mark.usefixtures("prefect_server")

GUEST_W = {"intercept": -0.4, "age": 0.8, "bmi": -1.25}
HOST_W = {"glucose": 1.5, "insulin": 0.3, "crp": -0.7}


def _tables(workspace: Path) -> tuple[TableRef, TableRef, pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(5)
    guest_ids, host_ids = rng.permutation(np.arange(0, 60)), rng.permutation(np.arange(15, 90))
    guest = pd.DataFrame({"id": guest_ids, "age": rng.normal(size=60), "bmi": rng.normal(size=60)})
    guest["y"] = rng.integers(0, 2, size=60)
    host = pd.DataFrame({"id": host_ids, **{c: rng.normal(size=75) for c in HOST_W}})
    guest_ref = TableRef(str(workspace / "clinic.duckdb"), "new_patients", label_column="y",
                         label_domain=(0, 1), party="clinic")  # fmt: skip
    host_ref = TableRef(str(workspace / "lab.duckdb"), "new_tests", party="lab")
    PartyStore.of(guest_ref).import_frame(guest, guest_ref)
    PartyStore.of(host_ref).import_frame(host, host_ref)
    for ref, weights in ((guest_ref, GUEST_W), (host_ref, HOST_W)):  # slices, as training saves
        record = {"features": list(weights), "weights": np.array(list(weights.values()))}
        record["job_id"] = "vertical-0123456789abcdef"
        ArtifactStore(PartyStore.of(ref)).put(
            f"models/vertical/vertical-0123456789abcdef/{ref.party}", record, "model"
        )
    return guest_ref, host_ref, guest, host


def _read(ref: TableRef, table: str) -> pd.DataFrame:
    with duckdb.connect(ref.database, read_only=True) as con:
        return con.execute(f'SELECT * FROM "{table}"').df()


def test_vertical_scores_equal_the_plaintext_model_on_the_shared_rows(workspace: Path) -> None:
    guest_ref, host_ref, guest, host = _tables(workspace)
    result = score_vertical(guest_ref.to_dict(), [host_ref.to_dict()], workspace=str(workspace))
    assert result["model_job_id"] == "vertical-0123456789abcdef"  # the newest slice
    joined = guest.merge(host, on="id")
    assert result["rows"] == len(joined) == 45
    expected = GUEST_W["intercept"] + sum(
        joined[c] * w for c, w in {**GUEST_W, **HOST_W}.items() if c != "intercept"
    )
    scores = _read(guest_ref, result["scores_table"])
    by_id = dict(zip(scores["id"].astype(int), scores["score"], strict=True))
    np.testing.assert_allclose(
        [by_id[int(i)] for i in joined["id"]], expected.to_numpy(), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(scores["probability"], 1 / (1 + np.exp(-scores["score"])))
    from sklearn.metrics import roc_auc_score

    assert result["auc"] == pytest.approx(roc_auc_score(joined["y"], expected))
    # what crossed for scoring: one score share per aligned row, from the host to the guest
    log = channel_for(result["job_id"], str(workspace)).log()
    assert [(r.sender, r.receiver, r.kind) for r in log] == [("lab", "clinic", "score_share")]


def test_a_model_held_whole_scores_the_party_s_own_rows(workspace: Path) -> None:
    rng = np.random.default_rng(2)
    frame = pd.DataFrame({"id": range(30), "a": rng.normal(size=30), "b": rng.normal(size=30)})
    ref = TableRef(str(workspace / "hospital.duckdb"), "intake", party="hospital")
    PartyStore.of(ref).import_frame(frame, ref)
    model = model_record("horizontal-lr-x", ["a", "b"], np.array([0.5, -2.0, 0.25]), 3)
    ArtifactStore(PartyStore.of(ref)).put("horizontal/horizontal-lr-x/model", model, "model")
    result = score_local(ref.to_dict(), "horizontal/horizontal-lr-x/model")
    scores = _read(ref, result["scores_table"])
    np.testing.assert_allclose(scores["score"], 0.5 * frame["a"] - 2.0 * frame["b"] + 0.25)
    assert result["rows"] == 30 and result["auc"] is None  # no labels in the new table
