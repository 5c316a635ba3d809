"""Scoring steps: a stored model applied to a party's new rows, one party's step each.

Vertical models are split by party: each host scores the aligned new rows with its own slice
and sends the guest only that score share ``X_h w_h`` (as FATE's predict job does); the guest
adds its own share and the intercept. A model a party holds whole is applied where it lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core.preprocessing import FittedPreprocessing, PreprocessingError
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from storage.workspace import channel_for
from tasks.policy import PARTY_STEP
from tasks.reporting import model_table


class ScoringError(ValueError):
    """The model or the new table cannot be scored (missing model, missing columns)."""


@dataclass(frozen=True)
class ScoringJob:
    """One scoring run: which model, and the channel its score shares cross."""

    job_id: str
    model_job_id: str
    guest: str
    workspace: str | None

    def endpoint(self, party: str) -> Any:
        return channel_for(self.job_id, self.workspace).endpoint(party)


@dataclass(frozen=True)
class ModelSlice:
    """What scoring needs of a stored model (or a party's slice of one)."""

    features: list[str]
    weights: np.ndarray
    intercept: float
    preprocessing: FittedPreprocessing | None  # None: a model trained on the stored values
    clip: float | None = None


def _slice(ref: TableRef, key: str) -> ModelSlice:
    record = ArtifactStore(PartyStore.of(ref)).get(key)
    if record is None:
        raise ScoringError(f"party {ref.party}: no model {key!r} in {ref.path.name}")
    rows, intercept = model_table(record)
    fitted = record.get("preprocessing")
    return ModelSlice(
        [r["feature"] for r in rows],
        np.array([r["coefficient"] for r in rows]),
        intercept or 0.0,
        None if fitted is None else FittedPreprocessing.from_dict(fitted),
        record.get("clip_features"),
    )


def _matrix(ref: TableRef, model: ModelSlice) -> tuple[Any, np.ndarray]:
    """The new rows' features as the model was trained on them: the model's own imputation
    and scaling statistics (fitted on the training rows) applied, then its clipping."""
    fitted = model.preprocessing
    frame = PartyStore.of(ref).read_table(ref, allow_missing=fitted is not None)
    raw = model.features if fitted is None else fitted.input_names
    missing = [f for f in raw if f not in frame.columns]
    if missing:
        raise ScoringError(
            f"party {ref.party}: table {ref.table!r} lacks the model's columns {missing}"
        )
    X = frame.loc[:, raw].to_numpy(dtype=float)
    if fitted is None:
        return frame, X
    try:
        X = fitted.transform(X, f"party {ref.party}, table {ref.table!r}")
    except PreprocessingError as error:
        raise ScoringError(str(error)) from None
    if model.clip is not None:
        X = np.clip(X, -model.clip, model.clip)
    columns = fitted.output_names
    return frame, X[:, [columns.index(f) for f in model.features]]


def latest_model(ref: TableRef, prefix: str, suffix: str = "") -> str:
    """The key of the newest model in the party's store whose key has this prefix/suffix."""
    listed = [
        (created, key)
        for key, kind, _, created in ArtifactStore(PartyStore.of(ref)).list(prefix)
        if kind == "model" and key.endswith(suffix)
    ]
    if not listed:
        raise ScoringError(f"party {ref.party}: no model under {prefix!r} in {ref.path.name}")
    return max(listed)[1]


def latest_vertical_job(ref: TableRef) -> str:
    """The job id of the newest vertical model slice in the party's store."""
    return latest_model(ref, "models/vertical/", f"/{ref.party}").split("/")[2]


@task(name="score-host-share", task_run_name="{ref.party}: score share of new rows", **PARTY_STEP)
def host_score_share(job: ScoringJob, ref: TableRef) -> int:
    """A host's share ``X_h w_h`` of the aligned new rows, sent to the guest."""
    model = _slice(ref, f"models/vertical/{job.model_job_id}/{ref.party}")
    _, X = _matrix(ref, model)
    job.endpoint(ref.party).send(job.guest, "score_share", X @ model.weights, round=0)
    return len(X)


@task(name="score-guest", task_run_name="{ref.party}: scores of new rows", **PARTY_STEP)
def guest_scores(job: ScoringJob, ref: TableRef, hosts: list[str]) -> dict[str, Any]:
    """The guest adds its share, the intercept and the hosts' shares; stores the scores."""
    model = _slice(ref, f"models/vertical/{job.model_job_id}/{ref.party}")
    frame, X = _matrix(ref, model)
    scores = X @ model.weights + model.intercept
    for host in hosts:
        share = np.asarray(job.endpoint(ref.party).receive(host, "score_share", round=0))
        if share.shape != scores.shape:
            raise ScoringError(f"{host} sent {share.shape} score shares for {len(scores)} rows")
        scores = scores + share
    return _store_scores(ref, frame, scores)


@task(
    name="score-local", task_run_name="{ref.party}: score new rows with {model_key}", **PARTY_STEP
)
def local_scores(ref: TableRef, model_key: str) -> dict[str, Any]:
    """A model the party holds whole, applied to its own new rows."""
    model = _slice(ref, model_key)
    frame, X = _matrix(ref, model)
    return _store_scores(ref, frame, X @ model.weights + model.intercept)


def _store_scores(ref: TableRef, frame: Any, scores: np.ndarray) -> dict[str, Any]:
    from sklearn.metrics import roc_auc_score

    probabilities = 1.0 / (1.0 + np.exp(-scores))
    table = f"{ref.table}_scored"  # not _scores: training's own predictions live there
    PartyStore.of(ref).write_table(
        table, frame[[ref.id_column]].assign(score=scores, probability=probabilities)
    )
    result: dict[str, Any] = {"rows": len(scores), "scores_table": table, "auc": None}
    if ref.label_column and ref.label_column in frame.columns:
        labels = frame[ref.label_column].to_numpy(dtype=float)
        if len(set(labels.tolist())) == 2:
            result["auc"] = float(roc_auc_score(labels, scores))
    get_run_logger().info("%s: %d rows scored into %s", ref.party, len(scores), table)
    return result
