"""The coordinator's steps of sparse LDA: compare the sites' columns, call the secure sum, fit
the model on the noisy sum, send it, and collect the held-out counts."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task

from core.job_schema import SparseLDAOptions
from core.sparse_lda import (
    NO_THRESHOLD,
    ColumnMismatchError,
    PartyData,
    ThresholdRule,
    check_columns_usable,
    fit_centralized,
    model_from_average,
    model_from_statistics,
)
from federation.channel import PartyEndpoint
from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore
from tasks import secure_sum
from tasks.policy import PARTY_STEP
from tasks.preprocessing import stored_fitted
from tasks.secure_sum import SumContext
from tasks.sparse_lda import (
    SparseLDAJob,
    call_terms,
    model_key,
    model_record,
    noise_calibration,
    schema_key,
    sum_context,
)


@dataclass(frozen=True)
class Coordinator:
    """The coordinator's side of a job, built once by its flow: the job, the options it waits
    by, its endpoint (the job's channel as the coordinator) and its own store."""

    job: SparseLDAJob
    options: SparseLDAOptions
    endpoint: PartyEndpoint = field(compare=False, repr=False)
    store: PartyStore = field(compare=False, repr=False)

    def features(self) -> list[str]:
        """The agreed column order (stored by :func:`open_job`)."""
        return ArtifactStore(self.store).get(schema_key(self.job.job_id))

    def publish(self, record: dict[str, Any]) -> None:
        """Store the job's model and send it to every site."""
        ArtifactStore(self.store).put(model_key(self.job.job_id), record, "model")
        for party in self.job.parties:
            self.endpoint.send(party, "model", record)

    def record(self, features: list[str], model: Any, **extra: Any) -> dict[str, Any]:
        """:func:`tasks.sparse_lda.model_record`, with the job's pooled statistics if any."""
        fitted = stored_fitted(str(self.store.path), self.job.job_id)
        statistics = None if fitted is None else fitted.to_dict()
        return model_record(self.job, features, model, statistics, **extra)


@task(name="sparse-lda-open-job", task_run_name="coordinator: compare columns", **PARTY_STEP)
def open_job(side: Coordinator) -> list[str]:
    """Refuse parties whose feature columns differ; send everyone the agreed order (those
    silent until ``join_timeout``: :func:`tasks.secure_sum.announced`)."""
    job = side.job
    messages = secure_sum.announced(side.endpoint, "schema", job, side.options.join_timeout)
    schemas = {p: message["feature_columns"] for p, message in messages.items()}
    announced = list(schemas)
    first = announced[0]
    expected = list(schemas[first])
    for party in announced[1:]:
        columns = schemas[party]
        missing = [c for c in expected if c not in columns]
        extra = [c for c in columns if c not in expected]
        if missing or extra:
            raise ColumnMismatchError(
                f"party {party!r}: feature columns differ from party {first!r}'s: missing "
                f"{missing}, extra {extra}; every party needs the same columns"
            )
    flat = {p: m["degenerate_columns"] for p, m in messages.items() if "degenerate_columns" in m}
    check_columns_usable(flat, expected)
    ArtifactStore(side.store).put(schema_key(job.job_id), expected, "schema")
    for party in job.parties:
        side.endpoint.send(party, "schema_agreed", expected)
    return expected


@task(name="sparse-lda-call-sum", task_run_name="coordinator: call the secure sum", **PARTY_STEP)
def call_sum(side: Coordinator, n_features: int, rule: ThresholdRule) -> SumContext:
    """Send every site the secure sum's call (a fresh session id and the job's parameters), a
    sent one as it was (a restart keeps every session record valid)."""
    job, endpoint = side.job, side.endpoint
    call = endpoint.sent(job.parties[0], "sum_call")
    if call is None:
        session = f"{job.job_id}/{secrets.token_hex(8)}"
        timeout = side.options.stage_timeout
        call = {"session_id": session, "stage_timeout": timeout, **call_terms(job, rule)}
    for party in job.parties:
        endpoint.send(party, "sum_call", call)
    return sum_context(job, n_features, call["session_id"], float(call["stage_timeout"]))


@task(
    name="sparse-lda-average", task_run_name="coordinator: average, threshold, store", **PARTY_STEP
)
def build_model(side: Coordinator, ctx: SumContext, rule: ThresholdRule) -> dict[str, Any]:
    """Fit on the securely summed vectors (party unit: average, hard-threshold), store and
    broadcast; a model stored already is the job's and is sent again as it is."""
    job = side.job
    stored = ArtifactStore(side.store).get(model_key(job.job_id))
    if stored is not None:
        side.publish(stored)
        return stored
    total, senders = secure_sum.stored_sum(ctx)
    features = side.features()
    contributors, total_rows = len(senders), round(float(total[-1]))
    calibration = noise_calibration(job, len(features)) if job.private else None
    if job.row_unit:
        sum_std = calibration.sum_std(contributors) if calibration else 0.0
        noise_std = sum_std / total_rows  # per entry of the pooled covariance
        rule = NO_THRESHOLD  # the pooled L1 fit is sparse by itself
        model = model_from_statistics(
            total[:-1], len(features), total_rows, sum_std, job.privacy(), job.fit_settings()
        )
    else:
        noise_std = calibration.average_std(contributors) if calibration else 0.0
        if job.method != "debiased":
            rule = NO_THRESHOLD  # the naive baseline averages the biased fits as they are
        model = model_from_average(total[:-1] / contributors, rule, total_rows, noise_std)
    record = side.record(
        features,
        model,
        contributors=senders,
        total_rows=total_rows,
        hard_threshold=rule.threshold(len(features), total_rows, noise_std),
        noise_std_of_average=noise_std,
    )
    side.publish(record)
    get_run_logger().info(
        "job %s: %s model from %d parties, %d of %d features kept",
        job.job_id,
        job.method,
        contributors,
        len(record["support"]),
        len(features),
    )
    return record


@task(
    name="sparse-lda-pooled-reference",
    task_run_name="coordinator: fit pooled rows (NOT PRIVATE reference)",
    **PARTY_STEP,
)
def fit_pooled_reference(side: Coordinator) -> dict[str, Any]:
    """``centralized_reference``: one fit on every party's rows, which the coordinator holds."""
    job, features = side.job, side.features()
    parties = []
    for party in job.parties:
        rows = side.endpoint.receive(party, "rows_not_private")
        parties.append(PartyData(party, rows["features"], rows["labels"], tuple(features)))
    model = fit_centralized(parties, job.fit_settings())
    record = side.record(
        features,
        model,
        contributors=list(job.parties),
        total_rows=sum(p.n_rows for p in parties),
        hard_threshold=0.0,
        noise_std_of_average=0.0,
    )
    side.publish(record)
    return record


@task(name="sparse-lda-scores", task_run_name="coordinator: collect held-out counts", **PARTY_STEP)
def collect_scores(side: Coordinator, contributors: list[str]) -> list[dict[str, int]]:
    """The contributors' held-out counts that arrive within the stage timeout (those missing
    are named in the log)."""
    deadline = time.monotonic() + side.options.stage_timeout
    found = secure_sum.collect(side.endpoint, "holdout_score", contributors, 0, deadline)
    if missing := [p for p in contributors if p not in found]:
        get_run_logger().warning("job %s: no held-out counts from %s", side.job.job_id, missing)
    return [found[p] for p in contributors if p in found]
