"""Sparse LDA across parties (Tian, Jayaraman, Gu & Evans 2016): what both sides share (the
agreed job, the release's calibration and key, reading a site's rows, the saved model's format).
Maths: :mod:`core.sparse_lda`. More: docs/protocols/sparse-lda.md."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from core.dp.distributed import honest_shares
from core.holdout import seeded_holdout_rows
from core.job_schema import SparseLDAOptions
from core.model_format import ModelRecord
from core.preprocessing import FittedPreprocessing, PreprocessingSpec
from core.preprocessing import fit_local as fit_own_statistics
from core.sparse_lda import (
    MAX_FEATURES,
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
    check_contribution,
    fit_local,
    statistics_norm_bound,
    statistics_vector,
)
from core.sparse_lda.dantzig import DEFAULT_DIRECTION_RADIUS_SCALE
from core.sparse_lda.privacy import add_noise_share, party_level_blocks, release_dimension
from storage import models
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks.preprocessing import needs_statistics, stored_fitted
from tasks.reporting import job_name
from tasks.secure_sum import SumContext
from tasks.summaries import model_matrix

PROTOCOL = "sparse_lda"
RELEASE_VERSION = "sparse-lda/v2"
MECHANISM = "sparse-lda discrete Gaussian shares (zCDP calibration)"
#: The options that shape a site's release (:class:`SparseLDAJob`'s fields); the others set
#: the model's hard threshold (the call states it) and the waits.
RELEASE_OPTIONS = {
    "epsilon", "delta", "direction_clip_norm", "mean_clip_norm", "method", "privacy_unit",
    "row_clip_norm", "holdout_fraction", "lambda_scale", "precision_method", "colluding_parties",
}  # fmt: skip


class SparseLDASetupError(ValueError):
    """The parameters or a party's descriptor cannot be used."""


@dataclass(frozen=True)
class SparseLDAJob:
    """Everything a step needs besides its own table: public, small, a task parameter."""

    job_id: str
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
        """Everything that shapes a party's release."""
        return {**asdict(self), "parties": list(self.parties)}

    @classmethod
    def of(
        cls,
        job_id: str,
        parties: list[str],
        options: SparseLDAOptions,
        threshold: int,
        preprocessing: dict[str, Any],
    ) -> SparseLDAJob:
        """The job of these options: every site's and the coordinator's alike."""
        released = options.model_dump(include=RELEASE_OPTIONS)
        return cls(
            job_id, tuple(parties), threshold=threshold, preprocessing=preprocessing, **released
        )


def check_job(job: SparseLDAJob) -> None:
    """Refuse what the options' schema cannot say alone, before any party does anything: a
    naive average of row-level releases, settings the core refuses, too many colluders."""
    if job.row_unit and job.method == "naive":
        raise SparseLDASetupError(
            "method 'naive' averages local fits, which only the party-level release protects; "
            "use privacy_unit='party'"
        )
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
    return calibrate(job.privacy(), n_features, honest_shares(job.threshold, job.colluding_parties))


def contribution_vector(
    data: PartyData, job: SparseLDAJob, calibration: NoiseCalibration | None
) -> np.ndarray:
    """The vector the party sends (row unit: clipped statistics; party unit: the local fit's
    ``direction | mu1 | mu2``), checked, naming the party, before its noise share is added."""
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
        PROTOCOL, job.job_id, 0, session_id, job.parties, job.threshold, dimension,
        stage_timeout=stage_timeout,
    )  # fmt: skip


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


def schema_key(job_id: str) -> str:
    """Where the coordinator keeps the agreed column order."""
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
    """``X`` filled by the job's rule from this party's own observed cells (0 where a column
    has none), unscaled: for its checks before the pooled statistics exist, never a release."""
    seen = ~np.isnan(X).all(axis=0)
    names = [c for c, s in zip(columns, seen, strict=True) if s]
    own = fit_own_statistics(X[:, seen], names, replace(spec, scaling="none"))
    filled = np.zeros_like(X)
    filled[:, seen] = own.transform(X[:, seen])
    return filled


def _frame_and_features(
    ref: TableRef, columns: list[str] | None, job: SparseLDAJob | None, scaled: bool
) -> tuple[Any, np.ndarray, list[str]]:
    """The party's table and its features in ``columns`` order (default: all but the id and the
    label), with the job's pooled statistics when ``scaled`` (else :func:`_own_fill`)."""
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
    """The party's rows as validated :class:`PartyData` in ``columns`` order (as
    :func:`_frame_and_features`); with ``job``: the training rows only."""
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


def model_record(
    job: SparseLDAJob,
    features: list[str],
    model: LinearDiscriminant,
    preprocessing: dict[str, Any] | None,
    **extra: Any,
) -> dict[str, Any]:
    """The saved model in the common format: the score ``x @ direction + intercept`` is the
    discriminant's ``(x - (mu1 + mu2)/2) @ direction``, positive for label 1."""
    direction = np.asarray(model.direction, dtype=np.float64)
    midpoint = (np.asarray(model.mean_positive) + np.asarray(model.mean_negative)) / 2.0
    record = ModelRecord.linear(
        PROTOCOL,
        job.job_id,
        features,
        direction,
        -float(midpoint @ direction),
        preprocessing=preprocessing,
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


def discriminant(model: dict[str, Any]) -> LinearDiscriminant:
    """The saved model as the core's decision rule (predict, error_rate, decision_scores)."""
    return LinearDiscriminant(
        np.asarray(model["direction"]),
        np.asarray(model["mean_positive"]),
        np.asarray(model["mean_negative"]),
    )


def call_terms(job: SparseLDAJob, rule: ThresholdRule) -> dict[str, Any]:
    """What every site must agree on before it contributes: the job's release parameters
    (method, privacy, threshold, colluders, parties...) and the model's hard threshold."""
    return {"job": job.release_parameters(), "rule": [rule.scale, rule.noise_multiplier]}
