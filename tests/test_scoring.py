"""Scoring flows: a stored model applied to new rows equals the plaintext model on them."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from core.model_format import ModelRecord
from federation.workspace import channel_for
from flows.scoring import score_vertical
from storage.descriptor import TableRef
from storage.models import ModelStore, NoPromotedModelError, model_key
from storage.party_store import PartyStore

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
    for ref, weights in ((guest_ref, GUEST_W), (host_ref, HOST_W)):  # shares, as training saves
        features = {f: w for f, w in weights.items() if f != "intercept"}
        share = ModelRecord.linear(
            "vertical", JOB, list(features), list(features.values()), weights.get("intercept"),
            party=ref.party, share=True,
        )  # fmt: skip
        # the training saw ids 0-29 (25-29 held out); a share names its own party's rows
        ModelStore(PartyStore.of(ref)).save(model_key("vertical", JOB, ref.party), share,
                                            range(25), range(25, 30))  # fmt: skip
    return guest_ref, host_ref, guest, host


JOB = "vertical-0123456789abcdef"


def _read(ref: TableRef, table: str) -> pd.DataFrame:
    with duckdb.connect(ref.database, read_only=True) as con:
        return con.execute(f'SELECT * FROM "{table}"').df()


def test_vertical_scores_equal_the_plaintext_model_on_the_shared_rows(workspace: Path) -> None:
    guest_ref, host_ref, guest, host = _tables(workspace)
    with pytest.raises(NoPromotedModelError, match="privreg models promote"):  # never the newest
        score_vertical(guest_ref.to_dict(), [host_ref.to_dict()], workspace=str(workspace))
    ModelStore(PartyStore.of(guest_ref)).promote(model_key("vertical", JOB, "clinic"), "monthly")
    result = score_vertical(
        guest_ref.to_dict(), [host_ref.to_dict()], job="monthly", workspace=str(workspace)
    )
    assert result["model_job_id"] == JOB and result["scores_table"] == "new_patients_scored"
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
    roles = {
        int(i): r if isinstance(r, str) else None
        for i, r in zip(scores["id"], scores["in_training"], strict=True)
    }
    assert {i for i, r in roles.items() if r == "held out"} == set(range(25, 30))
    assert {i for i, r in roles.items() if r == "train"} == set(range(15, 25))  # shared ones
    assert result["in_training"] == {"train": 10, "held out": 5, "unseen": 30}
    from sklearn.metrics import roc_auc_score

    assert result["auc"] == pytest.approx(roc_auc_score(joined["y"], expected))
    # what crossed for scoring: the training job's name, then one score share per aligned
    # row, from the host to the guest
    log = channel_for(result["job_id"], str(workspace)).log()
    assert [(r.sender, r.receiver, r.kind) for r in log] == [
        ("clinic", "lab", "score_alignment"), ("clinic", "lab", "score_model"),
        ("lab", "clinic", "score_alignment_same"), ("lab", "clinic", "score_share"),
    ]  # fmt: skip
