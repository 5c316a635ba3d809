"""Sparse LDA across parties (Tian, Jayaraman, Gu & Evans 2016), one task per party step.

The maths is in :mod:`core.sparse_lda`; the sum is :mod:`tasks.secure_sum`. Each party fits
its sparse discriminant on its own rows, debiases it, and stores *one* release in its own
store: ``clip(direction) | clip(mu1) | clip(mu2)`` on the grid ``g = 2^-24`` plus its share of
discrete Gaussian noise, then its row count. The secure sum masks that stored vector, so no
one (not the coordinator, not the flow) ever sees a party's vector, and no one sees the
noiseless sum. The coordinator averages, hard-thresholds and stores the model.

Privacy (party-level (epsilon, delta)-DP of the released sum, hence row-level too):

* Sensitivity: ``2 sqrt(C_beta^2 + 2 C_mu^2) + g sqrt(3 d)``, the bound of
  :func:`core.sparse_lda.privacy.sum_sensitivity` (any change to one party, after clipping).
* Calibration: ``zcdp_sigma`` (:mod:`core.dp.discrete_privacy`), a proven bound for the
  *discrete* Gaussian the samplers draw (as in :mod:`core.sparse_lda.privacy`). Shares are
  sized by the secure-sum threshold rather than the party count (below), so this module
  clips, grids and adds the noise share itself, with the core's helpers.
* Shares: each party adds ``sigma / sqrt(t - c)``, t the secure-sum threshold and c
  ``colluding_parties``. The coordinator unmasks only sums of at least t senders, so every
  released sum carries at least ``t - c`` shares no colluder knows: variance >= sigma^2.
  (A sum of discrete Gaussians is not exactly one; at sigma / g ~ 10^7 the gap is negligible.)
* Not protected: the total row count (summed exactly, treated as public as in the core),
  the feature names, which parties took part.
* Ledger: the release is stored and charged in one transaction under a key derived from the
  salted table fingerprint and every parameter that shapes it (the job id included, as it
  fixes the other parties), so a retry or re-run reuses it and is charged nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core.dp import gaussian_on_grid, zcdp_sigma
from core.sparse_lda import (
    MAX_FEATURES,
    NO_THRESHOLD,
    ColumnMismatchError,
    DimensionLimitError,
    LinearDiscriminant,
    LocalEstimate,
    LocalFitSettings,
    PartyData,
    PrecisionMethod,
    PrivacySettings,
    ThresholdRule,
    fit_centralized,
    fit_local,
    model_from_average,
    party_contribution,
    sum_sensitivity,
)
from core.sparse_lda.dantzig import DEFAULT_DIRECTION_RADIUS_SCALE
from core.sparse_lda.privacy import clip_to_norm, round_to_grid
from storage.artifacts import ArtifactStore
from storage.channel import PartyEndpoint
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from storage.policy import OwnerPolicy
from storage.workspace import channel_for
from tasks import secure_sum
from tasks.loading import fingerprint
from tasks.policy import PARTY_STEP
from tasks.secure_sum import COORDINATOR, SumContext, coordinator_store

PROTOCOL = "sparse_lda"
RELEASE_VERSION = "sparse-lda/v1"
MECHANISM = "sparse-lda discrete Gaussian shares (zCDP calibration)"
METHODS = ("debiased", "naive", "centralized_reference")
BLOCKS = 3  # direction, mean of label 1, mean of label 0


class SparseLDASetupError(ValueError):
    """The parameters or a party's descriptor cannot be used."""


@dataclass(frozen=True)
class SparseLDAJob:
    """Everything a step needs besides its own table: public, small, a task parameter."""

    job_id: str
    workspace: str | None
    parties: tuple[str, ...]
    method: str
    epsilon: float
    delta: float
    direction_clip_norm: float
    mean_clip_norm: float
    threshold: int  # secure-sum threshold: fewest senders the coordinator may unmask
    colluding_parties: int = 0
    lambda_scale: float = DEFAULT_DIRECTION_RADIUS_SCALE
    precision_method: str = PrecisionMethod.NODEWISE_LASSO.value
    noise_disabled_for_testing: bool = False

    @property
    def private(self) -> bool:
        """Whether the output is a DP release (false for the pooled reference and tests)."""
        return self.method != "centralized_reference" and not self.noise_disabled_for_testing

    def endpoint(self, party: str) -> PartyEndpoint:
        return channel_for(self.job_id, self.workspace).endpoint(party)

    def fit_settings(self) -> LocalFitSettings:
        return LocalFitSettings(
            direction_radius_scale=self.lambda_scale,
            precision_method=PrecisionMethod(self.precision_method),
        )

    def privacy(self) -> PrivacySettings:
        return PrivacySettings(
            self.epsilon,
            self.delta,
            self.direction_clip_norm,
            self.mean_clip_norm,
            self.colluding_parties,
            noise_disabled_for_testing=self.noise_disabled_for_testing,
        )

    def release_parameters(self) -> dict[str, Any]:
        """Everything that shapes a party's release (not the workspace)."""
        values = asdict(self)
        values.pop("workspace")
        values["parties"] = list(self.parties)
        return values


def check_job(job: SparseLDAJob) -> None:
    """Refuse unusable public parameters before any party does anything."""
    if job.method not in METHODS:
        raise SparseLDASetupError(f"method must be one of {', '.join(METHODS)}; got {job.method!r}")
    try:
        PrecisionMethod(job.precision_method)
    except ValueError:
        choices = ", ".join(m.value for m in PrecisionMethod)
        raise SparseLDASetupError(
            f"precision_method must be one of {choices}; got {job.precision_method!r}"
        ) from None
    job.fit_settings()
    job.privacy()
    if job.private and not 0 <= job.colluding_parties < job.threshold:
        raise SparseLDASetupError(
            f"colluding_parties = {job.colluding_parties} must be in [0, threshold - 1 = "
            f"{job.threshold - 1}]: the noise shares of the threshold's senders minus the "
            "colluders must still add up to the calibrated sigma"
        )


# ---------------------------------------------------------------------------------------------
# Noise: calibration and one party's share


@dataclass(frozen=True)
class NoiseCalibration:
    """Public noise parameters of one job (they depend only on parameters and d)."""

    sensitivity: float
    sigma: float  # std the released sum carries at least
    share_sigma: float  # std of one party's share
    honest_shares: int  # t - c: shares every unmaskable sum holds that no colluder knows
    granularity: float

    def average_std(self, contributors: int) -> float:
        """Per-coordinate noise std of the average over ``contributors`` noisy vectors."""
        return self.share_sigma * math.sqrt(contributors) / contributors


def noise_calibration(job: SparseLDAJob, n_features: int) -> NoiseCalibration:
    """sigma for (epsilon, delta) with a proven discrete-Gaussian bound, split into shares."""
    privacy = job.privacy()
    sensitivity = sum_sensitivity(privacy, n_features)
    sigma = zcdp_sigma(job.epsilon, job.delta, sensitivity)
    honest = job.threshold - job.colluding_parties
    return NoiseCalibration(
        sensitivity, sigma, sigma / math.sqrt(honest), honest, privacy.grid_granularity
    )


def noise_share(calibration: NoiseCalibration, size: int) -> np.ndarray:
    """One party's noise share: exact discrete Gaussian on the grid (CSPRNG)."""
    return gaussian_on_grid(calibration.share_sigma, calibration.granularity, size)


def contribution_vector(
    estimate: LocalEstimate, job: SparseLDAJob, calibration: NoiseCalibration | None
) -> np.ndarray:
    """``direction | mu1 | mu2`` as the party sends it: clipped, on the grid, plus its share.

    With noise disabled for testing, the exact unclipped blocks (the core's noiseless mode).
    """
    debiased = job.method == "debiased"
    if job.noise_disabled_for_testing or calibration is None:
        noiseless = PrivacySettings.noiseless_for_testing()
        return party_contribution(estimate, noiseless, len(job.parties), debiased=debiased)
    direction = estimate.debiased_direction if debiased else estimate.sparse_direction
    assert direction is not None  # fit_local ran with debiased=(method == "debiased")
    blocks = [
        clip_to_norm(direction, job.direction_clip_norm),
        clip_to_norm(estimate.mean_positive, job.mean_clip_norm),
        clip_to_norm(estimate.mean_negative, job.mean_clip_norm),
    ]
    exact = round_to_grid(np.concatenate(blocks), calibration.granularity)
    return exact + noise_share(calibration, exact.size)


# ---------------------------------------------------------------------------------------------
# Keys and reading one's own table


def sum_context(job: SparseLDAJob, n_features: int, session_id: str) -> SumContext:
    """The one secure-sum session of a run: ``direction | mu1 | mu2 | rows`` per party."""
    dimension = BLOCKS * n_features + 1
    return SumContext(
        PROTOCOL, job.job_id, 0, session_id, job.parties, job.threshold, dimension, job.workspace
    )


def release_key(table_fingerprint: str, job: SparseLDAJob) -> str:
    """Names a release by the salted table digest and every parameter that shapes it."""
    text = json.dumps(
        {"version": RELEASE_VERSION, "table": table_fingerprint, **job.release_parameters()},
        sort_keys=True,
    )
    return "sparse-lda-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def input_key(job_id: str) -> str:
    """Where a party keeps the vector the secure sum masks (in its own store)."""
    return f"{PROTOCOL}/{job_id}/sum-input"


def model_key(job_id: str) -> str:
    return f"models/{PROTOCOL}/{job_id}"


def _schema_key(job_id: str) -> str:
    return f"{PROTOCOL}/{job_id}/schema"


def read_party(ref: TableRef, columns: list[str] | None = None) -> PartyData:
    """The party's rows as validated :class:`PartyData` (both classes, d within the limit).

    ``columns`` fixes the feature order (the coordinator's agreed one); by default every
    column but the id and the label, in storage order.
    """
    if ref.label_column is None:
        raise SparseLDASetupError(f"party {ref.party!r}: the descriptor names no label_column")
    _check_width(ref)
    frame = PartyStore.of(ref).read_table(ref)
    if columns is None:
        columns = [c for c in frame.columns if c not in (ref.id_column, ref.label_column)]
    return PartyData(
        name=ref.party,
        features=frame[columns].to_numpy(dtype=np.float64),
        labels=frame[ref.label_column].to_numpy(),
        columns=tuple(columns),
    )


def _check_width(ref: TableRef) -> None:
    """Refuse a table wider than the solver limit from its column names, before reading rows."""
    store = PartyStore.of(ref)
    if ref.feature_columns is not None:
        width = len(ref.feature_columns)
    elif store.has_table(ref.table):
        with store.connect() as con:
            names = [d[0] for d in con.execute(f'SELECT * FROM "{ref.table}" LIMIT 0').description]
        width = len([c for c in names if c not in (ref.id_column, ref.label_column)])
    else:
        return  # read_table names the missing table
    if width > MAX_FEATURES:
        raise DimensionLimitError(
            f"party {ref.party!r}: {width} features exceeds the supported maximum of "
            f"{MAX_FEATURES} for the dense LP solver (core.sparse_lda.MAX_FEATURES); select or "
            "screen features first"
        )


def _agreed_features(job: SparseLDAJob, party: str) -> list[str]:
    return list(job.endpoint(party).receive(COORDINATOR, "schema_agreed"))


# ---------------------------------------------------------------------------------------------
# Party steps


def check_owner_allows(ref: TableRef, job: SparseLDAJob) -> None:
    """Options that give up privacy run only where the table's owner allowed them."""
    policy = OwnerPolicy(PartyStore.of(ref))
    if job.method == "centralized_reference":
        what = "sending its raw rows to the coordinator (method='centralized_reference')"
        policy.require(ref.party, ref.table, "allow_raw_export", what)
    elif job.noise_disabled_for_testing:
        what = "a release without noise (noise_disabled_for_testing)"
        policy.require(ref.party, ref.table, "allow_noiseless_release", what)


@task(name="sparse-lda-check-table", task_run_name="{ref.party}: check {ref.table}", **PARTY_STEP)
def check_table(ref: TableRef) -> str:
    """Validate the own table before anything is computed or sent; return its salted digest.

    Refuses a missing class (fewer than two rows of label 0 or 1), labels other than 0/1,
    more features than the LP solver's limit, and non-finite values, naming party and column.
    """
    read_party(ref)
    return fingerprint.fn(ref)


@task(name="sparse-lda-join", task_run_name="{ref.party}: check budget, send columns", **PARTY_STEP)
def join_job(ref: TableRef, job: SparseLDAJob) -> dict[str, Any]:
    """Refuse a release the budget cannot pay for, then send the coordinator the feature
    column names (no rows, no row count). A stored release of the same job is not charged."""
    check_owner_allows(ref, job)
    data = read_party(ref)
    reused, budget = False, None
    if job.private:
        ledger = PrivacyLedger(PartyStore.of(ref))
        reused = ledger.stored_release(release_key(fingerprint.fn(ref), job)) is not None
        if reused:
            budget = ledger.status(ref.table).as_dict()
        else:
            budget = ledger.require_affordable(ref.table, job.epsilon, job.delta).as_dict()
    job.endpoint(ref.party).send(COORDINATOR, "schema", {"feature_columns": list(data.columns)})
    return {"reused": reused, "budget": budget}


def _build_release(
    job: SparseLDAJob, ref: TableRef, features: list[str], calibration: NoiseCalibration | None
) -> dict[str, Any]:
    data = read_party(ref, features)
    estimate = fit_local(data, job.fit_settings(), debiased=job.method == "debiased")
    release: dict[str, Any] = {
        "vector": contribution_vector(estimate, job, calibration),
        "rows": data.n_rows,
        "method": job.method,
        "features": features,
    }
    if calibration is not None:
        release["noise"] = asdict(calibration)
    return release


@task(
    name="sparse-lda-release",
    task_run_name="{ref.party}: fit, clip, add noise share, store",
    **PARTY_STEP,
)
def release_contribution(ref: TableRef, job: SparseLDAJob) -> dict[str, Any]:
    """Fit on own rows and store (and charge, once) the noisy vector the secure sum masks.

    Over budget is refused before anything is computed. A stored release (a retry, a re-run)
    is reused as it is: nothing is recomputed or charged. Returns only public values.
    """
    check_owner_allows(ref, job)
    store = PartyStore.of(ref)
    features = _agreed_features(job, ref.party)
    key, reused, budget = None, False, None
    if job.private:
        calibration = noise_calibration(job, len(features))
        key = release_key(fingerprint.fn(ref), job)
        ledger = PrivacyLedger(store)
        release = ledger.stored_release(key)
        reused = release is not None
        if release is None:
            ledger.require_affordable(ref.table, job.epsilon, job.delta)  # before computing
            release = ledger.charge_and_store(
                key,
                ref.table,
                job.epsilon,
                job.delta,
                MECHANISM,
                job.job_id,
                _build_release(job, ref, features, calibration),
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
    task_run_name="{ref.party}: send rows to coordinator (NOT PRIVATE reference)",
    **PARTY_STEP,
)
def send_rows_not_private(ref: TableRef, job: SparseLDAJob) -> None:
    """``centralized_reference`` only: the party's rows go to the coordinator in the clear.

    This is what the protocol exists to avoid; it gives the accuracy pooled data could reach.
    """
    if job.method != "centralized_reference":
        raise SparseLDASetupError(f"refusing to send rows for method {job.method!r}")
    check_owner_allows(ref, job)
    data = read_party(ref, _agreed_features(job, ref.party))
    payload = {"features": data.features, "labels": data.labels.astype(np.int64)}
    job.endpoint(ref.party).send(COORDINATOR, "rows_not_private", payload)


@task(name="sparse-lda-keep-model", task_run_name="{ref.party}: keep model", **PARTY_STEP)
def keep_model(ref: TableRef, job: SparseLDAJob, ctx: SumContext | None = None) -> None:
    """Store the coordinator's model in the own store; drop the secure-sum session's secrets."""
    store = PartyStore.of(ref)
    model = job.endpoint(ref.party).receive(COORDINATOR, "model")
    if model["job_id"] != job.job_id:
        raise SparseLDASetupError(f"{ref.party}: the model message belongs to another job")
    ArtifactStore(store).put(model_key(job.job_id), model, "model")
    if ctx is not None:
        secure_sum.forget_session(store, ctx, ref.party)


# ---------------------------------------------------------------------------------------------
# Coordinator steps


@task(name="sparse-lda-open-job", task_run_name="coordinator: compare columns", **PARTY_STEP)
def open_job(job: SparseLDAJob) -> list[str]:
    """Refuse parties whose feature columns differ; send everyone the agreed order."""
    endpoint = job.endpoint(COORDINATOR)
    schemas = {p: endpoint.receive(p, "schema")["feature_columns"] for p in job.parties}
    first = job.parties[0]
    expected = list(schemas[first])
    for party in job.parties[1:]:
        columns = schemas[party]
        missing = [c for c in expected if c not in columns]
        extra = [c for c in columns if c not in expected]
        if missing or extra:
            raise ColumnMismatchError(
                f"party {party!r}: feature columns differ from party {first!r}'s: missing "
                f"{missing}, extra {extra}; every party needs the same columns"
            )
    ArtifactStore(coordinator_store(job.workspace)).put(_schema_key(job.job_id), expected, "schema")
    for party in job.parties:
        endpoint.send(party, "schema_agreed", expected)
    return expected


def _model_record(
    job: SparseLDAJob, features: list[str], model: LinearDiscriminant, **extra: Any
) -> dict[str, Any]:
    """The saved model: plain values only, so it goes through the safe codec."""
    direction = np.asarray(model.direction, dtype=np.float64)
    return {
        "job_id": job.job_id,
        "method": job.method,
        "private": job.private,
        "epsilon": job.epsilon if job.private else None,
        "delta": job.delta if job.private else None,
        "features": list(features),
        "direction": direction,
        "mean_positive": np.asarray(model.mean_positive, dtype=np.float64),
        "mean_negative": np.asarray(model.mean_negative, dtype=np.float64),
        "support": [f for f, w in zip(features, direction, strict=True) if w != 0.0],
        **extra,
    }


def _publish_model(job: SparseLDAJob, record: dict[str, Any]) -> None:
    store = coordinator_store(job.workspace)
    ArtifactStore(store).put(model_key(job.job_id), record, "model")
    endpoint = job.endpoint(COORDINATOR)
    for party in job.parties:
        endpoint.send(party, "model", record)


@task(
    name="sparse-lda-average", task_run_name="coordinator: average, threshold, store", **PARTY_STEP
)
def build_model(job: SparseLDAJob, ctx: SumContext, rule: ThresholdRule) -> dict[str, Any]:
    """Average the securely summed vectors, hard-threshold the direction, store and broadcast.

    The coordinator sees only the (noisy) sum and how many vectors it holds; the threshold's
    noise term uses public values only, so thresholding is post-processing.
    """
    total, senders = secure_sum.stored_sum(ctx)
    features = ArtifactStore(coordinator_store(job.workspace)).get(_schema_key(job.job_id))
    contributors, total_rows = len(senders), round(float(total[-1]))
    noise_std = 0.0
    if job.private:
        noise_std = noise_calibration(job, len(features)).average_std(contributors)
    if job.method != "debiased":
        rule = NO_THRESHOLD  # the naive baseline averages the biased fits as they are
    model = model_from_average(total[:-1] / contributors, rule, total_rows, noise_std)
    record = _model_record(
        job,
        features,
        model,
        contributors=senders,
        total_rows=total_rows,
        hard_threshold=rule.threshold(len(features), total_rows, noise_std),
        noise_std_of_average=noise_std,
    )
    _publish_model(job, record)
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
def fit_pooled_reference(job: SparseLDAJob) -> dict[str, Any]:
    """``centralized_reference``: one fit on every party's rows, which the coordinator holds."""
    endpoint = job.endpoint(COORDINATOR)
    features = ArtifactStore(coordinator_store(job.workspace)).get(_schema_key(job.job_id))
    parties = []
    for party in job.parties:
        rows = endpoint.receive(party, "rows_not_private")
        parties.append(PartyData(party, rows["features"], rows["labels"], tuple(features)))
    model = fit_centralized(parties, job.fit_settings())
    record = _model_record(
        job,
        features,
        model,
        contributors=list(job.parties),
        total_rows=sum(p.n_rows for p in parties),
        hard_threshold=0.0,
        noise_std_of_average=0.0,
    )
    _publish_model(job, record)
    return record


def discriminant(model: dict[str, Any]) -> LinearDiscriminant:
    """The saved model as the core's decision rule (predict, error_rate, decision_scores)."""
    return LinearDiscriminant(
        np.asarray(model["direction"]),
        np.asarray(model["mean_positive"]),
        np.asarray(model["mean_negative"]),
    )
