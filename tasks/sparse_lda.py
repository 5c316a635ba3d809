"""Sparse LDA across parties (Tian, Jayaraman, Gu & Evans 2016), one task per party step.

The maths is in :mod:`core.sparse_lda`; the sum is :mod:`tasks.secure_sum`. Each party fits
its sparse discriminant on its own rows, debiases it, and stores *one* release in its own
store: ``clip(direction) | clip(mu1) | clip(mu2)`` on the grid ``g = 2^-24`` plus its share of
discrete Gaussian noise, then its row count. The secure sum masks that stored vector, so no
one (not the coordinator, not the flow) ever sees a party's vector, and no one sees the
noiseless sum. The coordinator averages, hard-thresholds and stores the model.

Privacy unit (``privacy_unit``):

* ``row`` (default): each party releases its clipped sufficient statistics (class sums,
  class counts, second moments; :mod:`core.sparse_lda.moments_release`) and the coordinator
  fits the sparse discriminant on their noisy sum. (epsilon, delta)-DP for one row (one
  patient) of one party; the noise on the model falls as the total row count grows.
* ``party``: each party releases ``clip(direction) | clip(mu1) | clip(mu2)`` of its local
  debiased fit (``method="naive"``: the un-debiased fit); the guarantee covers everything one
  party holds, so the noise does not fall with rows.

* Sensitivity and calibration: :func:`core.sparse_lda.privacy.calibrate`, the only place the
  noise is calibrated (proven discrete-Gaussian zCDP bound); this module only says how many
  honest shares a released sum holds.
* Shares: each party adds ``sigma / sqrt(t - c)``, t the secure-sum threshold and c
  ``colluding_parties``. The coordinator unmasks only sums of at least t senders, so every
  released sum carries at least ``t - c`` shares no colluder knows: variance >= sigma^2.
  (A sum of discrete Gaussians is not exactly one; at sigma / g ~ 10^7 the gap is negligible.)
* Not protected: the total row count (summed exactly, treated as public as in the core),
  the feature names, which parties took part, which columns a party reports constant
  (party unit only), and the held-out error and label counts (rows kept out of the
  release, scored with the released model).
* Checked before the sum: every party checks its own vector (finite; within its norm bound)
  and refuses to send it otherwise, naming itself; a broken vector is never averaged in.
* Ledger: the release is stored and charged in one transaction under a key derived from the
  salted table fingerprint and every parameter that shapes it (the job id included, as it
  fixes the other parties), so a retry or re-run reuses it and is charged nothing.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core.holdout import seeded_holdout_rows
from core.model_format import ModelRecord
from core.preprocessing import FittedPreprocessing, PreprocessingSpec
from core.preprocessing import fit_local as fit_own_statistics
from core.secagg.errors import InsufficientSurvivorsError, ProtocolViolationError
from core.sparse_lda import (
    MAX_FEATURES,
    NO_THRESHOLD,
    ColumnMismatchError,
    DegenerateDataError,
    DimensionLimitError,
    LinearDiscriminant,
    LocalFitSettings,
    NoiseCalibration,
    PartyData,
    PrecisionMethod,
    PrivacySettings,
    PrivacyUnit,
    ThresholdRule,
    calibrate,
    check_columns_usable,
    check_contribution,
    degenerate_columns,
    fit_centralized,
    fit_local,
    model_from_average,
    model_from_statistics,
    require_both_classes,
    statistics_norm_bound,
    statistics_vector,
)
from core.sparse_lda.dantzig import DEFAULT_DIRECTION_RADIUS_SCALE
from core.sparse_lda.privacy import add_noise_share, party_level_blocks, release_dimension
from federation.channel import PartyEndpoint
from federation.workspace import channel_for
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
from tasks.preprocessing import needs_statistics, stored_fitted
from tasks.reporting import job_name, provenance
from tasks.secure_sum import COORDINATOR, SumContext, coordinator_store
from tasks.summaries import model_matrix

PROTOCOL = "sparse_lda"
RELEASE_VERSION = "sparse-lda/v2"
MECHANISM = "sparse-lda discrete Gaussian shares (zCDP calibration)"
METHODS = ("debiased", "naive", "centralized_reference")
UNITS = tuple(unit.value for unit in PrivacyUnit)


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
    direction_clip_norm: float | None
    mean_clip_norm: float | None
    threshold: int  # secure-sum threshold: fewest senders the coordinator may unmask
    colluding_parties: int = 0
    lambda_scale: float = DEFAULT_DIRECTION_RADIUS_SCALE
    precision_method: str = PrecisionMethod.NODEWISE_LASSO.value
    noise_disabled_for_testing: bool = False
    privacy_unit: str = PrivacyUnit.PARTY.value
    row_clip_norm: float | None = None
    holdout_fraction: float = 0.0
    holdout_seed: int = 0
    # the job's preprocessing (``core.preprocessing.PreprocessingSpec.to_dict``): the flows
    # pass theirs (standardise by default); a job built without one uses the stored values
    preprocessing: dict[str, Any] = field(
        default_factory=lambda: PreprocessingSpec(scaling="none").to_dict()
    )

    @property
    def spec(self) -> PreprocessingSpec:
        return PreprocessingSpec.from_dict(self.preprocessing)

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

    @property
    def row_unit(self) -> bool:
        return self.privacy_unit == PrivacyUnit.ROW.value

    def privacy(self) -> PrivacySettings:
        return PrivacySettings(
            self.epsilon,
            self.delta,
            self.direction_clip_norm,
            self.mean_clip_norm,
            self.colluding_parties,
            noise_disabled_for_testing=self.noise_disabled_for_testing,
            unit=self.privacy_unit,
            row_clip_norm=self.row_clip_norm,
        )

    def holdout_rows(self, rows: int) -> np.ndarray:
        """Rows kept out of the release to score the model; from public values only."""
        return seeded_holdout_rows(
            rows, self.holdout_fraction, self.holdout_seed, keep_for_training=4
        )

    def train_rows(self, rows: int) -> np.ndarray:
        """The other rows: what the release (and the pooled statistics) are computed from."""
        return np.setdiff1d(np.arange(rows), self.holdout_rows(rows))

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
    if job.privacy_unit not in UNITS:
        raise SparseLDASetupError(
            f"privacy_unit must be one of {', '.join(UNITS)}; got {job.privacy_unit!r}"
        )
    if job.row_unit and job.method == "naive":
        raise SparseLDASetupError(
            "method 'naive' averages local fits, which only the party-level release protects; "
            "use privacy_unit='party'"
        )
    if not 0.0 <= job.holdout_fraction < 1.0:
        raise SparseLDASetupError(f"holdout_fraction must be in [0, 1); got {job.holdout_fraction}")
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


def noise_calibration(job: SparseLDAJob, n_features: int) -> NoiseCalibration:
    """The core's calibration, for the ``t - c`` shares every unmaskable sum holds."""
    return calibrate(job.privacy(), n_features, job.threshold - job.colluding_parties)


def noise_share(calibration: NoiseCalibration, size: int) -> np.ndarray:
    """One party's noise share alone (exact discrete Gaussian on the grid, CSPRNG)."""
    return add_noise_share(np.zeros(size), calibration)


def contribution_vector(
    data: PartyData, job: SparseLDAJob, calibration: NoiseCalibration | None
) -> np.ndarray:
    """The vector the party sends, checked (finite, bounded) before its noise share is added.

    Row unit: clipped statistics. Party unit: ``direction | mu1 | mu2`` of the local fit,
    clipped (exact and unclipped with noise disabled for testing). A vector that fails the
    check is refused here, at its owner, naming the party: it never enters the sum.
    """
    privacy = job.privacy()
    if job.row_unit:
        exact = statistics_vector(data, privacy)
        bound = statistics_norm_bound(data.n_rows, privacy, data.n_features)
    else:
        estimate = fit_local(data, job.fit_settings(), debiased=job.method == "debiased")
        direction = (
            estimate.debiased_direction if job.method == "debiased" else estimate.sparse_direction
        )
        assert direction is not None  # fit_local ran with debiased=(method == "debiased")
        exact = party_level_blocks(
            direction, estimate.mean_positive, estimate.mean_negative, privacy
        )
        bound = None  # clipped already; the check refuses NaN and noise-free blow-ups
    check_contribution(data.name, exact, bound)
    if job.noise_disabled_for_testing or calibration is None:
        return exact
    return add_noise_share(exact, calibration)


# ---------------------------------------------------------------------------------------------
# Keys and reading one's own table


def sum_context(
    job: SparseLDAJob, n_features: int, session_id: str, stage_timeout: float = 60.0
) -> SumContext:
    """The one secure-sum session of a run: ``direction | mu1 | mu2 | rows`` per party."""
    dimension = release_dimension(job.privacy(), n_features) + 1
    return SumContext(
        PROTOCOL,
        job.job_id,
        0,
        session_id,
        job.parties,
        job.threshold,
        dimension,
        job.workspace,
        stage_timeout=stage_timeout,
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
    return models.model_key(PROTOCOL, job_id)


def _schema_key(job_id: str) -> str:
    return f"{PROTOCOL}/{job_id}/schema"


def job_statistics(ref: TableRef, job: SparseLDAJob) -> FittedPreprocessing | None:
    """The pooled statistics this party kept for the job (``tasks.preprocessing``), None when
    the job scales nothing; refused when the job needs them and the party has none yet."""
    if not needs_statistics(job.spec):
        return None
    fitted = stored_fitted(ref.database, job.job_id)
    if fitted is None:
        raise SparseLDASetupError(
            f"party {ref.party!r}: job {job.job_id} scales or imputes its features, and this "
            "party has no pooled statistics for it yet (they come from the job's first secure "
            "sum)"
        )
    return fitted


def _own_fill(X: np.ndarray, columns: list[str], spec: PreprocessingSpec) -> np.ndarray:
    """``X`` with its missing cells filled by the job's rule from this party's own observed
    cells, unscaled: for its checks before the pooled statistics exist (which classes, which
    columns are flat), never for a release. A column it never observes is filled with 0 (flat
    at this party whatever the pooled fill)."""
    seen = ~np.isnan(X).all(axis=0)
    names = [c for c, s in zip(columns, seen, strict=True) if s]
    own = fit_own_statistics(X[:, seen], names, replace(spec, scaling="none"))
    filled = np.zeros_like(X)
    filled[:, seen] = own.transform(X[:, seen])
    return filled


def _frame_and_features(
    ref: TableRef, columns: list[str] | None, job: SparseLDAJob | None, scaled: bool
) -> tuple[Any, np.ndarray, list[str]]:
    """The party's table and its feature matrix in ``columns`` order (default: every column
    but the id and the label), scaled and imputed with the job's pooled statistics when
    ``scaled``. Missing cells are refused (naming every column) unless the job imputes;
    unscaled, they are filled with the party's own statistics (:func:`_own_fill`)."""
    fitted = job_statistics(ref, job) if job is not None and scaled else None
    imputes = job is not None and job.spec.impute != "none"
    frame = PartyStore.of(ref).read_table(ref, allow_missing=fitted is not None or imputes)
    if columns is None:
        columns = [c for c in frame.columns if c not in (ref.id_column, ref.label_column)]
    where = f"party {ref.party}, table {ref.table!r}"
    features = model_matrix(frame, list(columns), fitted, where)
    if job is not None and fitted is None and imputes:
        features = _own_fill(features, list(columns), job.spec)
    return frame, features, list(columns)


def read_party(
    ref: TableRef,
    columns: list[str] | None = None,
    job: SparseLDAJob | None = None,
    scaled: bool = True,
) -> PartyData:
    """The party's rows as validated :class:`PartyData` (0/1 labels, d within the limit).

    ``columns`` fixes the feature order (the coordinator's agreed one); by default every
    column but the id and the label, in storage order. With ``job``, only the training rows
    (the job's held-out rows removed), scaled with the job's pooled statistics (unless not
    ``scaled``: before they exist).
    """
    if ref.label_column is None:
        raise SparseLDASetupError(f"party {ref.party!r}: the descriptor names no label_column")
    _check_width(ref)
    frame, features, columns = _frame_and_features(ref, columns, job, scaled)
    labels = frame[ref.label_column].to_numpy()
    if job is not None and job.holdout_fraction > 0:
        keep = job.train_rows(len(labels))
        features, labels = features[keep], labels[keep]
    return PartyData(ref.party, features, labels, tuple(columns))


def read_holdout(ref: TableRef, columns: list[str], job: SparseLDAJob) -> tuple:
    """The party's held-out rows (features, labels), in the agreed column order, scaled with
    the job's pooled statistics."""
    frame, features, _ = _frame_and_features(ref, columns, job, True)
    rows = job.holdout_rows(len(frame))
    return features[rows], frame[ref.label_column].to_numpy()[rows]


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


def agreed_features(job: SparseLDAJob, party: str) -> list[str]:
    """The column order the coordinator agreed (its message to ``party``)."""
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
        what = "a release without noise (test switch PRIVREG_TEST_NOISELESS)"
        policy.require(ref.party, ref.table, "allow_noiseless_release", what)


@task(name="sparse-lda-check-table", task_run_name="{ref.party}: check {ref.table}", **PARTY_STEP)
def check_table(ref: TableRef, job: SparseLDAJob) -> str:
    """Validate the own table before anything is computed or sent; return its salted digest.

    Refuses labels other than 0/1, more features than the LP solver's limit, non-finite
    values, missing cells unless the job imputes them (every affected column named with its
    count and ``preprocessing.impute``), training rows whose columns are all constant within
    classes and, for the party unit's local fit, a missing class (fewer than two training
    rows of label 0 or 1), naming party and column. The row unit sums any site's rows, so a
    site with one class takes part (a class missing at every site is refused from the
    released counts). Nothing is charged yet.
    """
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


@task(name="sparse-lda-join", task_run_name="{ref.party}: check budget, send columns", **PARTY_STEP)
def join_job(ref: TableRef, job: SparseLDAJob) -> dict[str, Any]:
    """Refuse a release the budget cannot pay for, then send the coordinator the feature
    column names (no rows, no row count). A stored release of the same job is not charged."""
    reused, budget = check_budget(ref, job)
    data = read_party(ref, job=job, scaled=False)  # before the pooled statistics exist
    schema: dict[str, Any] = {"feature_columns": list(data.columns)}
    if not job.row_unit:  # local fits leave these at zero; the coordinator refuses all-flat ones
        # constant within a class at any scale (missing cells: the party's own fill)
        schema["degenerate_columns"] = list(degenerate_columns(data))
    job.endpoint(ref.party).send(COORDINATOR, "schema", schema)
    return {"reused": reused, "budget": budget}


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
    features = agreed_features(job, ref.party)
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
    data = read_party(ref, agreed_features(job, ref.party), job)
    payload = {"features": data.features, "labels": data.labels.astype(np.int64)}
    job.endpoint(ref.party).send(COORDINATOR, "rows_not_private", payload)


def _model_rows(
    ref: TableRef, job: SparseLDAJob, model: dict[str, Any]
) -> tuple[list[object], list[object]]:
    """The ids of this party's rows the model trained on and held out, saved with its copy so
    scoring's ``in_training`` column is filled; none when its release is not in the model (a
    dropped party's rows were never seen)."""
    if ref.party not in model.get("contributors", []):
        return [], []
    ids = PartyStore.of(ref).read_table(ref, allow_missing=True)[ref.id_column].to_numpy(object)
    return ids[job.train_rows(len(ids))].tolist(), ids[job.holdout_rows(len(ids))].tolist()


@task(name="sparse-lda-keep-model", task_run_name="{ref.party}: keep model", **PARTY_STEP)
def keep_model(ref: TableRef, job: SparseLDAJob, ctx: SumContext | None = None) -> dict[str, Any]:
    """Store the coordinator's model in the own store; drop the secure-sum session's secrets."""
    store = PartyStore.of(ref)
    model = job.endpoint(ref.party).receive(COORDINATOR, "model")
    if model["job_id"] != job.job_id:
        raise SparseLDASetupError(f"{ref.party}: the model message belongs to another job")
    record = replace(ModelRecord.from_dict(model), party=ref.party, **provenance(ref))
    models.ModelStore(store).save(model_key(job.job_id), record, *_model_rows(ref, job, model))
    model = record.to_dict()
    if ctx is not None:
        secure_sum.forget_session(store, ctx, ref.party)
    return model


# ---------------------------------------------------------------------------------------------
# Coordinator steps


@task(name="sparse-lda-open-job", task_run_name="coordinator: compare columns", **PARTY_STEP)
def open_job(job: SparseLDAJob, timeout: float) -> list[str]:
    """Refuse parties whose feature columns differ; send everyone the agreed order.

    The parties' columns are awaited until one deadline, ``timeout`` from now: those that
    have not announced them by then are missing from the start (the secure sum drops them),
    and fewer than the threshold fails naming the missing parties.
    """
    endpoint = job.endpoint(COORDINATOR)
    found = secure_sum.collect(endpoint, "schema", job.parties, 0, time.monotonic() + timeout)
    messages = {p: found[p] for p in job.parties if p in found}
    missing = [p for p in job.parties if p not in messages]
    if len(messages) < job.threshold:
        raise InsufficientSurvivorsError(
            f"job {job.job_id}: only {sorted(messages)} announced their columns within "
            f"{timeout:g} s, fewer than the threshold {job.threshold}; missing: {missing}"
        )
    if missing:
        get_run_logger().warning("job %s: %s did not announce columns", job.job_id, missing)
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
    ArtifactStore(coordinator_store(job.workspace)).put(_schema_key(job.job_id), expected, "schema")
    for party in job.parties:
        endpoint.send(party, "schema_agreed", expected)
    return expected


def _model_record(
    job: SparseLDAJob, features: list[str], model: LinearDiscriminant, **extra: Any
) -> dict[str, Any]:
    """The saved model in the common format: the score ``x @ direction + intercept`` is the
    discriminant's ``(x - (mu1 + mu2)/2) @ direction``, positive for label 1."""
    direction = np.asarray(model.direction, dtype=np.float64)
    midpoint = (np.asarray(model.mean_positive) + np.asarray(model.mean_negative)) / 2.0
    fitted = stored_fitted(str(coordinator_store(job.workspace).path), job.job_id)
    record = ModelRecord.linear(
        PROTOCOL,
        job.job_id,
        features,
        direction,
        -float(midpoint @ direction),
        preprocessing=None if fitted is None else fitted.to_dict(),  # scoring applies them
        link="discriminant",
        job=job_name(),
        rows={"train": int(extra.get("total_rows", 0))},
        extras={
            "method": job.method,
            "private": job.private,
            "epsilon": job.epsilon if job.private else None,
            "delta": job.delta if job.private else None,
            "privacy_unit": job.privacy_unit if job.private else None,
            "direction": direction,
            "mean_positive": np.asarray(model.mean_positive, dtype=np.float64),
            "mean_negative": np.asarray(model.mean_negative, dtype=np.float64),
            "support": [f for f, w in zip(features, direction, strict=True) if w != 0.0],
            **extra,
        },
    )
    return record.to_dict()


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
    noise term uses public values only, so thresholding is post-processing. A model already
    stored for the job (a restarted coordinator, a re-run) is the job's model: it is sent
    again as it is (the channel would refuse another one under the same key anyway).
    """
    stored = ArtifactStore(coordinator_store(job.workspace)).get(model_key(job.job_id))
    if stored is not None:
        _publish_model(job, stored)
        return stored
    total, senders = secure_sum.stored_sum(ctx)
    features = ArtifactStore(coordinator_store(job.workspace)).get(_schema_key(job.job_id))
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


@task(name="sparse-lda-score", task_run_name="{ref.party}: score held-out rows", **PARTY_STEP)
def score_holdout(ref: TableRef, job: SparseLDAJob) -> dict[str, Any]:
    """Misclassified held-out rows under the kept model, and how many are label 1 (for the
    majority-class baseline): three counts, no rows, leave (to the coordinator, too)."""
    model = ArtifactStore(PartyStore.of(ref)).get(model_key(job.job_id))
    features, labels = read_holdout(ref, list(model["features"]), job)
    wrong = int(np.count_nonzero(discriminant(model).predict(features) != labels))
    positives = int(np.count_nonzero(labels == 1))
    score = {"rows": int(labels.size), "errors": wrong, "positives": positives}
    job.endpoint(ref.party).send(COORDINATOR, "holdout_score", score)
    # the ROC of its held-out rows stays with this party (its own chart), never sent to the
    # coordinator
    roc = held_out_roc(labels.astype(float), discriminant(model).decision_scores(features))
    return {**score, "roc": roc}


def discriminant(model: dict[str, Any]) -> LinearDiscriminant:
    """The saved model as the core's decision rule (predict, error_rate, decision_scores)."""
    return LinearDiscriminant(
        np.asarray(model["direction"]),
        np.asarray(model["mean_positive"]),
        np.asarray(model["mean_negative"]),
    )


# ---------------------------------------------------------------------------------------------
# Party mode: each site and the coordinator its own process; what a step needs is a message


def _call(job: SparseLDAJob, rule: ThresholdRule) -> dict[str, Any]:
    """What every site must agree on before it contributes: the job's release parameters
    (method, privacy, threshold, colluders, parties...) and the model's hard threshold."""
    return {"job": job.release_parameters(), "rule": [rule.scale, rule.noise_multiplier]}


@task(name="sparse-lda-call-sum", task_run_name="coordinator: call the secure sum", **PARTY_STEP)
def call_sum(
    job: SparseLDAJob, n_features: int, rule: ThresholdRule, stage_timeout: float
) -> SumContext:
    """Send every site the secure sum's call (a fresh session id and the job's parameters).

    A coordinator restarted after sending it re-sends the call it sent (same session), so its
    own session records and the sites' stay valid; a call is never changed once sent.
    """
    endpoint = job.endpoint(COORDINATOR)
    call = endpoint.sent(job.parties[0], "sum_call")
    if call is None:
        session = f"{job.job_id}/{secrets.token_hex(8)}"
        call = {"session_id": session, "stage_timeout": stage_timeout, **_call(job, rule)}
    for party in job.parties:
        endpoint.send(party, "sum_call", call)
    return sum_context(job, n_features, call["session_id"], float(call["stage_timeout"]))


@task(
    name="sparse-lda-await-sum",
    task_run_name="{ref.party}: await the secure sum's call",
    cache_policy=PARTY_STEP["cache_policy"],
)
def await_sum_call(ref: TableRef, job: SparseLDAJob, rule: ThresholdRule) -> SumContext:
    """The coordinator's call as this site's session context, if it names this site's job.

    A coordinator asking for other parameters (a lower threshold or more colluders would
    unmask sums with fewer noise shares than the calibration counts on; another method or
    privacy unit, other peers) is refused, naming what differs.
    """
    endpoint = job.endpoint(ref.party)
    call = endpoint.receive(COORDINATOR, "sum_call")
    agreed = _call(job, rule)
    asked = {**call["job"], "hard_threshold": call["rule"]}
    own = {**agreed["job"], "hard_threshold": agreed["rule"]}
    differ = [f"{k} {asked.get(k)!r} (agreed: {v!r})" for k, v in own.items() if asked.get(k) != v]
    if differ:
        raise ProtocolViolationError(
            f"{ref.party}: the coordinator's call for job {job.job_id} asks for "
            f"{'; '.join(differ)}; refusing to contribute"
        )
    n_features = len(agreed_features(job, ref.party))
    return sum_context(job, n_features, call["session_id"], float(call["stage_timeout"]))


def model_out(ref: TableRef, job: SparseLDAJob) -> bool:
    """Whether the coordinator has sent this site the job's model (the sum is over)."""
    endpoint = job.endpoint(ref.party)
    return bool(secure_sum.collect(endpoint, "model", [COORDINATOR], 0, 0))


def sum_done(ctx: SumContext) -> bool:
    """Whether the coordinator already holds this session's sum (a restarted coordinator
    then goes straight to the model)."""
    stored = ArtifactStore(coordinator_store(ctx.workspace)).get(ctx.sum_key)
    return stored is not None and stored["session_id"] == ctx.session_id


@task(name="sparse-lda-scores", task_run_name="coordinator: collect held-out counts", **PARTY_STEP)
def collect_scores(
    job: SparseLDAJob, contributors: list[str], timeout: float
) -> list[dict[str, int]]:
    """The contributors' held-out counts that arrive within ``timeout`` (a site gone since
    the sum is missing from the figures, and named in the log)."""
    endpoint = job.endpoint(COORDINATOR)
    found = secure_sum.collect(
        endpoint, "holdout_score", contributors, 0, time.monotonic() + timeout
    )
    if missing := [p for p in contributors if p not in found]:
        get_run_logger().warning("job %s: no held-out counts from %s", job.job_id, missing)
    return [found[p] for p in contributors if p in found]
