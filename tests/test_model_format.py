"""One model format for every flow: it round-trips through export, and scoring the stored,
promoted model gives what the exported model alone computes on the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from core.model_format import ModelFormatError, ModelRecord
from core.sparse_lda.model import LinearDiscriminant
from flows.scoring import score_local
from privreg.cli import main
from storage.descriptor import TableRef
from storage.models import ModelStore, NoPromotedModelError, model_key
from storage.party_store import PartyStore
from tasks.horizontal_lr import model_record
from tasks.sparse_lda import SparseLDAJob
from tasks.sparse_lda import model_record as sparse_lda_record

FEATURES = ["age", "bmi", "glucose"]
COEFFICIENTS = np.array([0.75, -1.5, 0.25])


def _horizontal() -> ModelRecord:
    weights = np.array([*COEFFICIENTS, -0.5])  # the training's vector ends with the intercept
    return ModelRecord.from_dict(model_record("horizontal-job", FEATURES, weights, 3))


def _sparse_lda() -> ModelRecord:
    job = SparseLDAJob("sparse-lda-job", ("a", "b"), "debiased", 1.0, 1e-6, None, None, 2)
    rule = LinearDiscriminant(COEFFICIENTS, np.array([1.0, 0.0, 2.0]), np.array([-1.0, 0.5, 0.0]))
    return ModelRecord.from_dict(sparse_lda_record(job, FEATURES, rule, None, total_rows=90))


def _walr() -> ModelRecord:
    return ModelRecord.linear("walr", "walr-job", FEATURES, COEFFICIENTS, 0.3,
                              extras={"noisy_sum": np.arange(4.0), "epsilon": 1.0})  # fmt: skip


def _label_dp() -> ModelRecord:
    return ModelRecord.linear("label_dp", "label-dp-job", FEATURES, COEFFICIENTS, 1.0,
                              link="log", extras={"mechanism": {"epsilon": 2.0}})  # fmt: skip


WHOLE = {"horizontal": _horizontal, "sparse_lda": _sparse_lda, "walr": _walr,
         "label_dp": _label_dp}  # fmt: skip


def _frame(rows: int = 40) -> pd.DataFrame:
    rng = np.random.default_rng(11)
    return pd.DataFrame({"id": range(rows), **{f: rng.normal(size=rows) for f in FEATURES}})


def _read(ref: TableRef, table: str) -> pd.DataFrame:
    with duckdb.connect(ref.database, read_only=True) as con:
        return con.execute(f'SELECT * FROM "{table}" ORDER BY id').df()


@pytest.mark.parametrize("flow", sorted(WHOLE))
def test_every_flow_s_model_has_the_common_fields_and_round_trips_through_json(flow: str) -> None:
    model = WHOLE[flow]()
    assert model.flow == flow and model.features == tuple(FEATURES)
    assert "intercept" not in model.features and len(model.coefficients) == len(FEATURES)
    stored = model.to_dict()
    assert list(stored["coefficients"]) == FEATURES  # one coefficient per named feature
    again = ModelRecord.from_json(model.to_json())
    assert again.to_json() == model.to_json() and again.extras.keys() == model.extras.keys()
    assert json.loads(model.to_json())["format"] == 1


def test_the_sparse_discriminant_scores_as_its_rule() -> None:
    model = _sparse_lda()
    rule = LinearDiscriminant(COEFFICIENTS, np.array([1.0, 0.0, 2.0]), np.array([-1.0, 0.5, 0.0]))
    X = _frame()[FEATURES].to_numpy()
    np.testing.assert_allclose(model.score(X), rule.decision_scores(X), atol=1e-12)
    assert np.array_equal(model.prediction(model.score(X)), rule.predict(X))


def test_a_share_names_its_holder_and_does_not_score_alone() -> None:
    share = ModelRecord.linear("vertical", "v", ["glucose"], [1.5], None, party="lab", share=True)
    assert ModelRecord.from_json(share.to_json()) == share
    with pytest.raises(ModelFormatError, match="one party's share"):
        share.score(np.ones((2, 1)))
    with pytest.raises(ModelFormatError, match="2 features but 1 coefficients"):
        ModelRecord.linear("walr", "w", ["a", "b"], [1.0], 0.0)
    with pytest.raises(ModelFormatError, match="not a model in the common format"):
        ModelRecord.from_dict({"features": ["intercept", "a"], "weights": [0.5, 1.0]})


@pytest.mark.usefixtures("prefect_server")
def test_every_flow_s_exported_model_scores_as_the_promoted_one(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frame = _frame()
    ref = TableRef(str(workspace / "hospital.duckdb"), "intake", party="hospital")
    PartyStore.of(ref).import_frame(frame, ref)
    models = ModelStore(PartyStore.of(ref))
    train, held_out = frame["id"][:20], frame["id"][20:25]  # ids 25.. are new to every model
    for flow, build in WHOLE.items():
        models.save(model_key(flow, build().job_id), build(), train, held_out)
    with pytest.raises(NoPromotedModelError, match="privreg models promote"):
        score_local(ref.to_dict(), job="demo", model_flow="walr")
    X = frame[FEATURES].to_numpy()
    for flow in WHOLE:
        key = model_key(flow, WHOLE[flow]().job_id)
        assert main(["models", "promote", "--database", ref.database, "--key", key,
                     "--job", "demo"]) == 0  # fmt: skip
        out = workspace / f"{flow}.json"
        assert main(["models", "export", "--database", ref.database, "--key", key,
                     "--out", str(out)]) == 0  # fmt: skip
        exported = ModelRecord.from_json(out.read_text())
        assert exported.to_json() == models.load(key).to_json()

        result = score_local(ref.to_dict(), job="demo", model_flow=flow)
        assert result["model_key"] == key
        scored = _read(ref, result["scores_table"])
        assert result["scores_table"] == "intake_scored"
        np.testing.assert_allclose(scored["score"], exported.score(X), rtol=1e-12, atol=1e-12)
        column = "probability" if exported.link == "logit" else "prediction"
        np.testing.assert_allclose(scored[column], exported.prediction(exported.score(X)))
        assert [r if isinstance(r, str) else None for r in scored["in_training"]] == (
            ["train"] * 20 + ["held out"] * 5 + [None] * 15
        )
        assert result["in_training"] == {"train": 20, "held out": 5, "unseen": 15}
    listed = capsys.readouterr().out
    assert main(["models", "list", "--database", ref.database]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(WHOLE) and all("promoted for demo" in line for line in lines)
    assert "now scores job demo" in listed


def test_a_saved_model_counts_the_rows_it_trained_on_and_held_out(workspace: Path) -> None:
    """A horizontal hospital's copy is saved with its ids but built without counts: its
    export says them (they were empty), beside the digest of the table it trained on."""
    ref = TableRef(str(workspace / "hospital.duckdb"), "intake", party="hospital")
    PartyStore.of(ref).import_frame(_frame(), ref)
    record = ModelRecord.from_dict(
        model_record("h-job", FEATURES, np.array([*COEFFICIENTS, -0.5]), 3,
                     origin={"job": "h", "fingerprints": {"hospital.intake": "ab12"}})
    )  # fmt: skip
    assert record.rows == {}
    models = ModelStore(PartyStore.of(ref))
    models.save(model_key("horizontal", "h-job"), record, range(20), range(20, 25))
    exported = json.loads(models.load(model_key("horizontal", "h-job")).to_json())
    assert exported["rows"] == {"train": 20, "held_out": 5}
    assert exported["fingerprints"] == {"hospital.intake": "ab12"}
    counted = ModelRecord.linear("walr", "w", FEATURES, COEFFICIENTS, 0.0, rows={"train": 7})
    models.save(model_key("walr", "w"), counted, range(20))  # a record's own counts stand
    assert models.load(model_key("walr", "w")).rows == {"train": 7}
