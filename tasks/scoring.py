"""Scoring steps: a stored model applied to a party's new rows, one party's step each.

More (the protocol, what each party learns, why): docs/protocols/scoring.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from prefect import get_run_logger, task

from core.model_format import ModelRecord
from core.preprocessing import FittedPreprocessing, PreprocessingError
from federation.channel import Channel, PartyEndpoint
from storage.descriptor import TableRef
from storage.lineage import StaleResultError
from storage.models import ModelStore, model_key
from storage.party_store import PartyStore
from tasks.policy import PARTY_STEP
from tasks.summaries import model_matrix

#: The scores table's column saying what the model's training did with a row.
IN_TRAINING = "in_training"


class ScoringError(ValueError):
    """The model or the new table cannot be scored (missing model, missing columns)."""


@dataclass(frozen=True)
class ScoringJob:
    """One scoring run: which model, and the channel its score shares cross."""

    job_id: str
    model_job_id: str
    guest: str
    channel: Channel = field(compare=False, repr=False)  # this side's, built once by its flow

    def endpoint(self, party: str) -> PartyEndpoint:
        return self.channel.endpoint(party)


@dataclass(frozen=True)
class ScoredRows:
    """What a scoring step reports (the scores stay in the party's store)."""

    rows: int
    scores_table: str
    model_key: str
    auc: float | None
    in_training: dict[str, int]  # rows the model trained on / held out / never saw


@task(name="promoted-model", task_run_name="{ref.party}: promoted {flow} model", **PARTY_STEP)
def promoted_model(ref: TableRef, job: str, flow: str) -> str:
    """The key of the model the party promoted for ``job`` and ``flow`` (refused if none)."""
    key, _ = ModelStore(PartyStore.of(ref)).promoted(job, flow)
    get_run_logger().info("%s: scoring with %s, promoted for job %s", ref.party, key, job)
    return key


def _load(ref: TableRef, key: str) -> ModelRecord:
    try:
        return ModelStore(PartyStore.of(ref)).load(key)
    except KeyError as error:
        raise ScoringError(f"party {ref.party}: {error.args[0]}") from None


def _matrix(ref: TableRef, model: ModelRecord) -> tuple[pd.DataFrame, np.ndarray]:
    """The new rows' features as the model was trained on them: the model's own imputation
    and scaling statistics (fitted on the training rows) applied, then its clipping."""
    fitted = (
        None if model.preprocessing is None else FittedPreprocessing.from_dict(model.preprocessing)
    )
    frame = PartyStore.of(ref).read_table(ref, allow_missing=fitted is not None)
    missing = [f for f in model.input_columns() if f not in frame.columns]
    if missing:
        raise ScoringError(
            f"party {ref.party}: table {ref.table!r} lacks the model's columns {missing}"
        )
    where = f"party {ref.party}, table {ref.table!r}"
    try:
        X = model_matrix(frame, list(model.features), fitted, where)
    except PreprocessingError as error:
        raise ScoringError(str(error)) from None
    if fitted is not None and model.clip is not None:  # clipped after the preprocessing only
        X = np.clip(X, -model.clip, model.clip)
    return frame, X


@task(name="score-model", task_run_name="{ref.party}: name the model", **PARTY_STEP)
def announce_model(job: ScoringJob, ref: TableRef, hosts: list[str]) -> None:
    """The guest names the training job whose shares score (its own share must exist)."""
    _load(ref, model_key("vertical", job.model_job_id, ref.party))
    job.endpoint(ref.party).send_many(hosts, "score_model", job.model_job_id)


@task(name="score-model-named", task_run_name="{ref.party}: the model named", **PARTY_STEP)
def announced_model(job: ScoringJob, ref: TableRef) -> str:
    """The training job the guest named; this host's share of it must exist here."""
    named = job.endpoint(ref.party).receive(job.guest, "score_model")
    if not isinstance(named, str):
        raise ScoringError(f"{job.guest} named no training job to score with ({named!r})")
    _load(ref, model_key("vertical", named, ref.party))
    return named


@task(name="score-alignment", task_run_name="{ref.party}: agree the alignment", **PARTY_STEP)
def agree_alignment(job: ScoringJob, ref: TableRef, peer: str, standing: str | None) -> bool:
    """Whether both parties use the alignment job ``standing`` names for their tables: the
    guest names its own (or none), the host answers whether its table's is the same."""
    endpoint = job.endpoint(ref.party)
    if ref.party == job.guest:  # a re-run keeps the first run's decision (messages stand)
        endpoint.send_once(peer, "score_alignment", lambda: standing or "")
        named = endpoint.sent(peer, "score_alignment")
        same = bool(endpoint.receive(peer, "score_alignment_same")) and bool(named)
    else:
        named = endpoint.receive(job.guest, "score_alignment")
        agrees = bool(named) and named == standing
        endpoint.send_once(job.guest, "score_alignment_same", lambda: agrees)
        same = bool(endpoint.sent(job.guest, "score_alignment_same"))
    if same and named != standing:
        raise StaleResultError(
            f"{ref.party}: scoring job {job.job_id} used the alignment of job {named}, which no "
            f"longer stands for table {ref.table!r}; start a new scoring run"
        )
    return same


@task(name="score-host-share", task_run_name="{ref.party}: score share of new rows", **PARTY_STEP)
def host_score_share(job: ScoringJob, ref: TableRef) -> int:
    """A host's share ``X_h w_h`` of the aligned new rows, sent to the guest."""
    model = _load(ref, model_key("vertical", job.model_job_id, ref.party))
    _, X = _matrix(ref, model)
    job.endpoint(ref.party).send(job.guest, "score_share", model.share_scores(X), round=0)
    return len(X)


@task(name="score-guest", task_run_name="{ref.party}: scores of new rows", **PARTY_STEP)
def guest_scores(job: ScoringJob, ref: TableRef, hosts: list[str], scores_table: str) -> ScoredRows:
    """The guest adds its share, the intercept and the hosts' shares; stores the scores."""
    key = model_key("vertical", job.model_job_id, ref.party)
    model = _load(ref, key)
    frame, X = _matrix(ref, model)
    scores = model.share_scores(X)
    for host in hosts:
        share = np.asarray(job.endpoint(ref.party).receive(host, "score_share", round=0))
        if share.shape != scores.shape:
            raise ScoringError(f"{host} sent {share.shape} score shares for {len(scores)} rows")
        scores = scores + share
    return _store_scores(ref, frame, scores, model, key, scores_table)


@task(
    name="score-local", task_run_name="{ref.party}: score new rows with {model_key}", **PARTY_STEP
)
def local_scores(ref: TableRef, model_key: str) -> ScoredRows:
    """A model the party holds whole, applied to its own new rows."""
    model = _load(ref, model_key)
    frame, X = _matrix(ref, model)
    return _store_scores(ref, frame, model.score(X), model, model_key, f"{ref.table}_scored")


def _store_scores(
    ref: TableRef,
    frame: pd.DataFrame,
    scores: np.ndarray,
    model: ModelRecord,
    key: str,
    table: str,  # <table>_scored: <table>_scores holds training's own predictions
) -> ScoredRows:
    from sklearn.metrics import roc_auc_score

    store = PartyStore.of(ref)
    ids = frame[ref.id_column]
    prediction = "probability" if model.link == "logit" else "prediction"
    roles = ModelStore(store).row_roles(key, ids.tolist())
    store.write_table(
        table,
        pd.DataFrame(
            {
                ref.id_column: ids.to_numpy(),
                "score": scores,
                prediction: model.prediction(scores),
                IN_TRAINING: pd.Series(roles, dtype="string"),
            }
        ),
    )
    counts = {
        "train": roles.count("train"),
        "held out": roles.count("held out"),
        "unseen": roles.count(None),
    }
    auc = None
    if ref.label_column and ref.label_column in frame.columns:
        labels = frame[ref.label_column].to_numpy(dtype=float)
        if len(set(labels.tolist())) == 2:
            auc = float(roc_auc_score(labels, scores))
    get_run_logger().info(
        "%s: %d rows scored into %s (%s)",
        ref.party,
        len(scores),
        table,
        ", ".join(f"{n} {what}" for what, n in counts.items()),
    )
    return ScoredRows(len(scores), table, key, auc, counts)


@task(name="promote-model", task_run_name="{ref.party}: promote {key}", **PARTY_STEP)
def promote_model(ref: TableRef, key: str, job: str) -> bool:
    """The job's pipeline makes the model it has just trained the one its scoring uses, and
    says so in the log; a party that holds no such model has nothing to promote (False)."""
    models = ModelStore(PartyStore.of(ref))
    if not models.artifacts.has(key):
        return False
    models.promote(key, job)
    get_run_logger().info(
        "%s: promoted %s for scoring of job %s (privreg models promote picks another)",
        ref.party,
        key,
        job,
    )
    return True
