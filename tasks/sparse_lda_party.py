"""A site's steps of sparse LDA: check its table and budget, announce its columns, store (and
charge, once) its noisy release, check the call, keep the model, score its held-out rows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core.dp.accounting import DiscreteGaussian
from core.model_format import ModelRecord
from core.secagg.errors import ProtocolViolationError
from core.sparse_lda import (
    DegenerateDataError,
    NoiseCalibration,
    ThresholdRule,
    degenerate_columns,
    require_both_classes,
)
from federation.channel import PartyEndpoint
from storage import models
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from tasks import secure_sum
from tasks.charts import held_out_roc
from tasks.loading import fingerprint
from tasks.policy import PARTY_STEP
from tasks.reporting import provenance
from tasks.secure_sum import COORDINATOR, SumContext
from tasks.sparse_lda import (
    MECHANISM,
    SparseLDAJob,
    SparseLDASetupError,
    call_terms,
    contribution_vector,
    discriminant,
    input_key,
    model_key,
    noise_calibration,
    read_holdout,
    read_party,
    release_key,
    sum_context,
)


@dataclass(frozen=True)
class Site:
    """One site's side of a job, built once by its flow: its own table, the job it agreed to
    and its endpoint (the job's channel as this site)."""

    ref: TableRef
    job: SparseLDAJob
    endpoint: PartyEndpoint = field(compare=False, repr=False)

    @property
    def party(self) -> str:
        return self.ref.party


def check_owner_allows(ref: TableRef, job: SparseLDAJob) -> None:
    """Options that give up privacy run only where the table's owner allowed them."""
    policy = OwnerPolicy(PartyStore.of(ref))
    if job.method == "centralized_reference":
        what = "sending its raw rows to the coordinator (method='centralized_reference')"
        policy.require(ref.party, ref.table, "allow_raw_export", what)
    elif job.noise_disabled_for_testing:
        what = "a release without noise (test switch PRIVREG_TEST_NOISELESS)"
        policy.require(ref.party, ref.table, "allow_noiseless_release", what)


@task(name="sparse-lda-check-table", task_run_name="{ref.party}: check {ref.table}", **PARTY_STEP)
def check_table(ref: TableRef, job: SparseLDAJob) -> str:
    """Validate the own table before anything is computed or sent (0/1 labels, width, finite or
    imputed cells, not all flat, party unit: two rows a class); return its salted digest."""
    data = read_party(ref, job=job, scaled=False)  # before the pooled statistics exist
    if not job.row_unit:
        require_both_classes(data)
    flat = degenerate_columns(data)
    if len(flat) == data.n_features:
        raise DegenerateDataError(
            f"party {ref.party!r}: every column is constant within each class (first: column "
            f"{flat[0]!r}); nothing to fit"
        )
    return fingerprint.fn(ref)


def check_budget(ref: TableRef, job: SparseLDAJob) -> tuple[bool, dict[str, Any] | None]:
    """Whether the owner allows the job and its budget pays for the release: (reused, budget
    status). A stored release of the same job is reused, so it needs no budget left."""
    check_owner_allows(ref, job)
    if not job.private:
        return False, None
    ledger = PrivacyLedger(PartyStore.of(ref))
    if ledger.stored_release(release_key(fingerprint.fn(ref), job)) is not None:
        return True, ledger.status(ref.table).as_dict()
    return False, ledger.require_affordable(ref.table, job.epsilon, job.delta).as_dict()


@task(
    name="sparse-lda-join", task_run_name="{site.party}: check budget, send columns", **PARTY_STEP
)
def join_job(site: Site) -> dict[str, Any]:
    """Refuse a release the budget cannot pay for, then send the coordinator the feature
    column names (no rows, no row count). A stored release of the same job is not charged."""
    ref, job = site.ref, site.job
    reused, budget = check_budget(ref, job)
    data = read_party(ref, job=job, scaled=False)  # before the pooled statistics exist
    schema: dict[str, Any] = {"feature_columns": list(data.columns)}
    if not job.row_unit:  # local fits leave these at zero; the coordinator refuses all-flat ones
        # constant within a class at any scale (missing cells: the party's own fill)
        schema["degenerate_columns"] = list(degenerate_columns(data))
    site.endpoint.send(COORDINATOR, "schema", schema)
    return {"reused": reused, "budget": budget}


def agreed_features(endpoint: PartyEndpoint) -> list[str]:
    """The column order the coordinator agreed (its answer to :func:`join_job`)."""
    return list(endpoint.receive(COORDINATOR, "schema_agreed"))


def _build_release(
    job: SparseLDAJob, ref: TableRef, features: list[str], calibration: NoiseCalibration | None
) -> dict[str, Any]:
    data = read_party(ref, features, job)
    release: dict[str, Any] = {
        "vector": contribution_vector(data, job, calibration),
        "rows": data.n_rows,
        "method": job.method,
        "features": features,
    }
    if calibration is not None:
        release["noise"] = asdict(calibration)
    return release


@task(
    name="sparse-lda-release",
    task_run_name="{site.party}: fit, clip, add noise share, store",
    **PARTY_STEP,
)
def release_contribution(site: Site, features: list[str]) -> dict[str, Any]:
    """Store, charged once (over budget: refused before computing), the noisy vector of the
    own rows the secure sum masks; a stored release is reused. Returns only public values."""
    ref, job = site.ref, site.job
    check_owner_allows(ref, job)
    store = PartyStore.of(ref)
    key, reused, budget = None, False, None
    if job.private:
        calibration = noise_calibration(job, len(features))
        key = release_key(fingerprint.fn(ref), job)
        ledger = PrivacyLedger(store)
        release = ledger.stored_release(key)
        reused = release is not None
        if release is None:
            # counted as one discrete Gaussian of sigma, the least any unmaskable sum carries
            g = calibration.granularity
            event = DiscreteGaussian(calibration.sensitivity / g, calibration.sigma / g, "vector")
            ledger.require_affordable(ref.table, job.epsilon, job.delta, event=event)
            release = ledger.charge_and_store(
                key,
                ref.table,
                job.epsilon,
                job.delta,
                MECHANISM,
                job.job_id,
                _build_release(job, ref, features, calibration),
                event=event,
            )
        budget = ledger.status(ref.table).as_dict()
    else:
        release = _build_release(job, ref, features, None)
        get_run_logger().warning(
            "%s: noise disabled for testing: the secure sum carries its exact vector (NOT "
            "differentially private, nothing charged)",
            ref.party,
        )
    vector = np.append(np.asarray(release["vector"], dtype=np.float64), float(release["rows"]))
    ArtifactStore(store).put(input_key(job.job_id), vector, "secure-sum-input")
    return {"release_key": key, "reused": reused, "budget": budget}


@task(
    name="sparse-lda-send-rows-not-private",
    task_run_name="{site.party}: send rows to coordinator (NOT PRIVATE reference)",
    **PARTY_STEP,
)
def send_rows_not_private(site: Site, features: list[str]) -> None:
    """``centralized_reference`` only: the party's rows go to the coordinator in the clear (what
    the protocol exists to avoid), for the accuracy pooled data could reach."""
    ref, job = site.ref, site.job
    if job.method != "centralized_reference":
        raise SparseLDASetupError(f"refusing to send rows for method {job.method!r}")
    check_owner_allows(ref, job)
    data = read_party(ref, features, job)
    payload = {"features": data.features, "labels": data.labels.astype(np.int64)}
    site.endpoint.send(COORDINATOR, "rows_not_private", payload)


def prefetch_sum_call(site: Site) -> None:
    """Fetch the coordinator's call of the secure sum while this site computes its release."""
    secure_sum.prefetch(site.endpoint, COORDINATOR, "sum_call")


@task(
    name="sparse-lda-await-sum",
    task_run_name="{site.party}: await the secure sum's call",
    cache_policy=PARTY_STEP["cache_policy"],
)
def await_sum_call(site: Site, rule: ThresholdRule, n_features: int) -> SumContext:
    """The coordinator's call as this site's session context, if it states this site's job
    (fewer noise shares than calibrated otherwise); else refused, naming what differs."""
    job = site.job
    call = site.endpoint.receive(COORDINATOR, "sum_call")
    agreed = call_terms(job, rule)
    asked = {**call["job"], "hard_threshold": call["rule"]}
    own = {**agreed["job"], "hard_threshold": agreed["rule"]}
    differ = [f"{k} {asked.get(k)!r} (agreed: {v!r})" for k, v in own.items() if asked.get(k) != v]
    if differ:
        raise ProtocolViolationError(
            f"{site.party}: the coordinator's call for job {job.job_id} asks for "
            f"{'; '.join(differ)}; refusing to contribute"
        )
    return sum_context(job, n_features, call["session_id"], float(call["stage_timeout"]))


def model_out(endpoint: PartyEndpoint) -> bool:
    """Whether the coordinator has sent this site the job's model (the sum is over)."""
    return secure_sum.coordinator_sent(endpoint, "model")


def _model_rows(
    ref: TableRef, job: SparseLDAJob, model: dict[str, Any]
) -> tuple[list[object], list[object]]:
    """The ids of this party's rows the model trained on and held out (for scoring's
    ``in_training``); none when its release is not in the model."""
    if ref.party not in model.get("contributors", []):
        return [], []
    ids = PartyStore.of(ref).read_table(ref, allow_missing=True)[ref.id_column].to_numpy(object)
    return ids[job.train_rows(len(ids))].tolist(), ids[job.holdout_rows(len(ids))].tolist()


@task(name="sparse-lda-keep-model", task_run_name="{site.party}: keep model", **PARTY_STEP)
def keep_model(site: Site, ctx: SumContext | None = None) -> dict[str, Any]:
    """Store the coordinator's model in the own store; drop the secure-sum session's secrets."""
    ref, job = site.ref, site.job
    store = PartyStore.of(ref)
    model = site.endpoint.receive(COORDINATOR, "model")
    if model["job_id"] != job.job_id:
        raise SparseLDASetupError(f"{ref.party}: the model message belongs to another job")
    record = replace(ModelRecord.from_dict(model), party=ref.party, **provenance(ref))
    models.ModelStore(store).save(model_key(job.job_id), record, *_model_rows(ref, job, model))
    model = record.to_dict()
    if ctx is not None:
        secure_sum.forget_session(store, ctx, ref.party)
    return model


@task(name="sparse-lda-score", task_run_name="{site.party}: score held-out rows", **PARTY_STEP)
def score_holdout(site: Site) -> dict[str, Any]:
    """Misclassified held-out rows under the kept model and how many are label 1: three counts
    to the coordinator; the ROC of the rows stays here (its own chart)."""
    ref, job = site.ref, site.job
    model = ArtifactStore(PartyStore.of(ref)).get(model_key(job.job_id))
    features, labels = read_holdout(ref, list(model["features"]), job)
    rule = discriminant(model)
    wrong = int(np.count_nonzero(rule.predict(features) != labels))
    positives = int(np.count_nonzero(labels == 1))
    score = {"rows": int(labels.size), "errors": wrong, "positives": positives}
    site.endpoint.send(COORDINATOR, "holdout_score", score)
    roc = held_out_roc(labels.astype(float), rule.decision_scores(features))
    return {**score, "roc": roc}
