"""Label-DP regression, one task per party step (the maths is in :mod:`core.label_dp`).

More (the protocol, what each party learns, why): docs/protocols/label-dp.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from prefect import get_run_logger, task

from core.dp.accounting import Composed, Event, PureDP
from core.holdout import seeded_holdout_rows
from core.ids import id_order_digest, require_aligned
from core.label_dp import (
    LabelGrid,
    clipped_laplace,
    exponential_mechanism,
    label_grid,
    pointwise_loss,
    private_prior,
    release_labels,
    split_budget,
    staircase_mechanism,
    train_on_noisy_labels,
)
from core.label_dp.grid import DEFAULT_GRID_SIZE
from core.label_dp.losses import check_loss
from core.label_dp.validation import check_epsilon
from core.model_format import ModelRecord
from core.preprocessing import FittedPreprocessing, PreprocessingSpec, fit_local
from federation.channel import Channel, PartyEndpoint
from storage import models
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from storage.validation import DataValidationError
from tasks import secure_sum
from tasks.charts import held_out_calibration
from tasks.loading import fingerprint
from tasks.policy import PARTY_STEP
from tasks.reporting import provenance
from tasks.summaries import model_matrix

if TYPE_CHECKING:
    from sklearn.pipeline import Pipeline

PROTOCOL = "label_dp"
RELEASE_VERSION = "label-dp/v1"
BASELINES = {
    "laplace": clipped_laplace,
    "exponential": exponential_mechanism,
    "staircase": staircase_mechanism,
}
MECHANISMS = ("rr_on_bins", *BASELINES)
#: Everything that changes the release (not the hold-out split, not the job id).
_RELEASE_PARAMETERS = ("epsilon", "loss", "label_range", "mechanism", "prior_epsilon", "grid_size",
                       "integer_labels", "clip")  # fmt: skip
#: What the features party receives: the release's parameters and the public hold-out split.
_TERMS = (*_RELEASE_PARAMETERS, "holdout_fraction", "seed")


class LabelDPSetupError(ValueError):
    """The parameters or the parties' tables cannot be used together."""


@dataclass(frozen=True)
class LabelDPJob:
    """Everything a step needs besides its own table: public, small, a task parameter."""

    job_id: str
    channel: Channel = field(compare=False, repr=False)  # this side's, built once by its flow
    labels_party: str
    features_party: str
    epsilon: float
    loss: str
    label_range: tuple[float, float]
    mechanism: str = "rr_on_bins"
    prior_epsilon: float | None = None
    grid_size: int = DEFAULT_GRID_SIZE
    integer_labels: bool = False
    clip: bool = True
    holdout_fraction: float = 0.2
    seed: int = 0

    def endpoint(self, party: str) -> PartyEndpoint:
        return self.channel.endpoint(party)

    def grid(self) -> LabelGrid:
        """The public grid: from the declared range only, never from the labels."""
        low, high = self.label_range
        return label_grid(low, high, integer=self.integer_labels, max_size=self.grid_size)

    def release_parameters(self) -> dict[str, Any]:
        """Everything that changes the release (not the hold-out split, not the job id)."""
        return {key: getattr(self, key) for key in _RELEASE_PARAMETERS}

    def split(self, rows: int) -> tuple[float, float]:
        """``(prior epsilon, label epsilon)``: public, as it depends only on sizes."""
        if self.mechanism == "rr_on_bins" or self.prior_epsilon is not None:
            return split_budget(self.epsilon, self.grid().size, rows, self.prior_epsilon)
        return 0.0, self.epsilon

    def holdout_rows(self, rows: int) -> np.ndarray:
        """Rows kept out of training; both parties derive them from public values."""
        return seeded_holdout_rows(rows, self.holdout_fraction, self.seed, keep_for_training=2)

    def train_rows(self, rows: int) -> np.ndarray:
        return np.setdiff1d(np.arange(rows), self.holdout_rows(rows))

    def evaluated_rows(self, rows: int) -> tuple[np.ndarray, str]:
        """The rows predictions are evaluated on, and which they are: the hold-out rows, or
        every row (in-sample) when nothing is held out."""
        held_out = self.holdout_rows(rows)
        if held_out.size:
            return held_out, "holdout"
        return np.arange(rows), "all rows (in-sample)"

    def terms(self) -> dict[str, Any]:
        """What the labels party tells the features party: the release's public parameters
        and the public hold-out split, so the features party trains for the same loss."""
        terms = {key: getattr(self, key) for key in _TERMS}
        terms["label_range"] = [float(v) for v in self.label_range]
        return terms

    @classmethod
    def from_terms(
        cls,
        channel: Channel,
        labels_party: str,
        features_party: str,
        terms: dict[str, Any],
    ) -> LabelDPJob:
        """The features party's view of the job, built from the terms it received."""
        low, high = terms["label_range"]
        fields = {k: v for k, v in terms.items() if k != "label_range"}
        return cls(
            channel.run, channel, labels_party, features_party, label_range=(low, high), **fields
        )


def check_parameters(job: LabelDPJob) -> None:
    """Refuse unusable public parameters before any party does anything."""
    check_epsilon(job.epsilon)
    check_loss(job.loss)
    if job.mechanism not in MECHANISMS:
        raise LabelDPSetupError(
            f"mechanism must be one of {', '.join(MECHANISMS)}; got {job.mechanism!r}"
        )
    if job.prior_epsilon is not None:
        check_epsilon(job.prior_epsilon, "prior_epsilon")
        job.split(1)  # refuses a prior share that leaves nothing for the labels
    low, high = job.label_range
    if job.loss == "poisson" and low < 0:
        raise LabelDPSetupError(f"poisson loss needs a label range >= 0; got [{low}, {high}]")
    job.grid()
    if not 0.0 <= job.holdout_fraction < 1.0:
        raise LabelDPSetupError(f"holdout_fraction must be in [0, 1); got {job.holdout_fraction}")
    if job.labels_party == job.features_party:
        raise LabelDPSetupError(f"both tables belong to party {job.labels_party!r}")


def release_key(table_fingerprint: str, job: LabelDPJob) -> str:
    """Names a release by the (salted) table digest and every parameter that shapes it."""
    text = json.dumps(
        {"version": RELEASE_VERSION, "table": table_fingerprint, **job.release_parameters()},
        sort_keys=True,
    )
    return "label-dp-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_labels(job: LabelDPJob, ref: TableRef) -> tuple[pd.DataFrame, np.ndarray]:
    """The labels party's table and labels: empty tables and missing or non-finite labels are
    refused by ``read_table`` (naming table, column and row), labels outside the declared range
    here unless clipped."""
    if ref.label_column is None:
        raise LabelDPSetupError(f"labels table {ref.table!r} declares no label column")
    frame = PartyStore.of(ref).read_table(ref)
    labels = frame[ref.label_column].to_numpy(dtype=float)
    low, high = job.label_range
    outside = (labels < low) | (labels > high)
    if not job.clip and outside.any():
        row = int(np.flatnonzero(outside)[0])
        raise DataValidationError(
            ref.table,
            ref.label_column,
            row + 1,
            f"label {labels[row]:g} is outside label_range [{low:g}, {high:g}] and clip is off "
            f"({int(outside.sum())} such labels)",
            frame[ref.id_column].iloc[row],
        )
    return frame, labels


def build_release(labels: np.ndarray, job: LabelDPJob) -> dict[str, Any]:
    """Prior, mechanism and noisy labels as a storable dict (CSPRNG draws throughout): RR-on-Bins
    by ``release_labels`` (the paper's Algorithm 3); a baseline spends all on the labels unless
    ``prior_epsilon`` buys a private prior (which sets the staircase's step width)."""
    grid = job.grid()
    if job.mechanism == "rr_on_bins":
        released = release_labels(
            labels, grid, job.epsilon, job.loss, prior_epsilon=job.prior_epsilon, clip=job.clip
        )
        mechanism, noisy = released.mechanism, released.noisy_labels
        eps1, eps2 = released.prior_epsilon, released.label_epsilon
        extra = {"bins": mechanism.bin_count, "keep_probability": mechanism.keep_probability}
    else:
        positions = grid.positions(labels, clip=job.clip)
        eps1, eps2 = job.split(len(positions))
        counts = np.bincount(positions, minlength=grid.size)
        prior = private_prior(counts, eps1) if eps1 > 0 else None
        mechanism = BASELINES[job.mechanism](grid.points, eps2, job.loss, prior)
        noisy = mechanism.randomize(grid.points[positions])
        extra = {"bins": len(mechanism.outputs)}
    summary = {
        "mechanism": job.mechanism,
        "loss": job.loss,
        "epsilon": job.epsilon,
        "prior_epsilon": eps1,
        "label_epsilon": eps2,
        "prior": "private histogram" if eps1 > 0 else "uniform (none released)",
        "grid_size": grid.size,
        "grid_low": grid.low,
        "grid_high": grid.high,
        **extra,
        "expected_loss": float(mechanism.expected_loss()),
    }
    return {
        "noisy_labels": np.asarray(noisy, dtype=np.float64),
        "outputs": np.asarray(mechanism.outputs, dtype=np.float64),
        "prior": np.asarray(mechanism.prior, dtype=np.float64),
        "summary": summary,
    }


def release_event(prior_epsilon: float, label_epsilon: float) -> Event:
    """The release's event for the ledger: every mechanism here (RR-on-Bins, Laplace,
    exponential, staircase, and the private prior) is pure epsilon-DP, so each part counts as
    the worst-case PLD of its epsilon, prior and channel composed."""
    parts = tuple(PureDP(e) for e in (prior_epsilon, label_epsilon) if e > 0)
    return parts[0] if len(parts) == 1 else Composed(parts)


# ---- labels party ---------------------------------------------------------------------------
@task(
    name="label-dp-check-labels", task_run_name="{ref.party}: check labels and budget", **PARTY_STEP
)
def check_labels(job: LabelDPJob, ref: TableRef) -> dict[str, Any]:
    """Validate the labels, refuse a release the budget cannot pay for, then send the features
    party a digest of the id order (the only message before the release).

    The features party's digest, sent unprompted when it starts, is fetched meanwhile:
    :func:`check_alignment` then reads it locally."""
    endpoint = job.endpoint(ref.party)
    secure_sum.prefetch(endpoint, job.features_party, "id_order_digest")
    frame, labels = _read_labels(job, ref)
    event = release_event(*job.split(len(labels)))
    key = release_key(fingerprint.fn(ref), job)
    ledger = PrivacyLedger(PartyStore.of(ref))
    reused = ledger.stored_release(key) is not None
    if reused:
        status = ledger.status(ref.table)
    else:
        status = ledger.require_affordable(ref.table, job.epsilon, 0.0, event=event)
    digest = id_order_digest(job.job_id, frame[ref.id_column])
    endpoint.send(job.features_party, "id_order_digest", digest)
    endpoint.send(job.features_party, "label_dp_terms", job.terms())
    return {"rows": len(labels), "release_key": key, "reused": reused, "budget": status.as_dict()}


@task(name="label-dp-aligned", task_run_name="{ref.party}: check alignment", **PARTY_STEP)
def check_alignment(job: LabelDPJob, ref: TableRef) -> None:
    """Compare the features party's digest with one's own (learns only equal or not), instead
    of waiting a round trip for its verdict: nothing is computed or charged before."""
    frame, _ = _read_labels(job, ref)
    theirs = job.endpoint(ref.party).receive(job.features_party, "id_order_digest")
    own = id_order_digest(job.job_id, frame[ref.id_column])
    require_aligned(own, theirs, ref.party, job.features_party, LabelDPSetupError)


@task(name="label-dp-release", task_run_name="{ref.party}: release noisy labels", **PARTY_STEP)
def release_noisy_labels(job: LabelDPJob, ref: TableRef) -> dict[str, Any]:
    """Compute (or find) the release, charged once, and send its noisy labels: one message.
    Returns only what is private or public: the mechanism summary (a function of the private
    prior) and the ledger status."""
    _, labels = _read_labels(job, ref)
    key = release_key(fingerprint.fn(ref), job)
    ledger = PrivacyLedger(PartyStore.of(ref))
    release = ledger.stored_release(key)
    reused = release is not None
    if release is None:
        event = release_event(*job.split(len(labels)))
        ledger.require_affordable(ref.table, job.epsilon, 0.0, event=event)  # before computing
        built = build_release(labels, job)
        event = release_event(built["summary"]["prior_epsilon"], built["summary"]["label_epsilon"])
        release = ledger.charge_and_store(
            key, ref.table, job.epsilon, 0.0, job.mechanism, job.job_id, built,
            consumer=job.features_party, event=event,
        )  # fmt: skip
    job.endpoint(ref.party).send(job.features_party, "noisy_labels", release["noisy_labels"])
    get_run_logger().info(
        "%s: %s release %s of %d noisy labels (epsilon %g)",
        ref.party,
        "reused" if reused else "new",
        key,
        len(release["noisy_labels"]),
        job.epsilon,
    )
    return {
        "release_key": key,
        "reused": reused,
        "summary": release["summary"],
        "budget": ledger.status(ref.table).as_dict(),
    }


@task(name="label-dp-evaluate", task_run_name="{ref.party}: evaluate predictions", **PARTY_STEP)
def evaluate(job: LabelDPJob, ref: TableRef) -> dict[str, Any]:
    """Test error against the true labels, which only the labels party can compute. Optional
    and outside the budget: this party learns the predictions on the evaluated rows, and whoever
    sees the result an exact (non-private) error."""
    _, labels = _read_labels(job, ref)
    rows, scope = job.evaluated_rows(len(labels))
    predictions = np.asarray(job.endpoint(ref.party).receive(job.features_party, "predictions"))
    if predictions.shape != rows.shape:
        raise LabelDPSetupError(
            f"expected {rows.size} predictions from {job.features_party}, got {predictions.shape}"
        )
    truth = labels[rows]
    result = {
        "evaluated_on": scope,
        "test_rows": int(rows.size),
        "test_mse": float(np.mean((predictions - truth) ** 2)),
        "calibration": held_out_calibration(truth, predictions),  # bins of >= 1/10 of the rows
    }
    if job.loss != "squared":
        result[f"test_{job.loss}_loss"] = _mean_loss(job, predictions, truth)
    return result


# ---- features party -------------------------------------------------------------------------
def _read_features(ref: TableRef) -> tuple[pd.DataFrame, np.ndarray, list[str]]:
    if ref.label_column is not None:
        raise LabelDPSetupError(
            f"features table {ref.table!r} declares label column {ref.label_column!r}: only the "
            "labels party may hold labels"
        )
    frame = PartyStore.of(ref).read_table(ref, allow_missing=True)  # imputed or refused later
    names = [c for c in frame.columns if c != ref.id_column]
    if not names:
        raise LabelDPSetupError(f"features table {ref.table!r} has no feature column")
    return frame, frame[names].to_numpy(dtype=float), names


def model_key(job_id: str) -> str:
    return models.model_key(PROTOCOL, job_id)


@task(name="label-dp-terms", task_run_name="{ref.party}: the release's terms", **PARTY_STEP)
def receive_terms(channel: Channel, labels_party: str, ref: TableRef) -> dict[str, Any]:
    """The features party learns the labels party's public release parameters and hold-out
    split (it trains for the loss the release was made for); unusable terms are refused."""
    terms = channel.endpoint(ref.party).receive(labels_party, "label_dp_terms")
    if not isinstance(terms, dict) or sorted(terms) != sorted(_TERMS):
        raise LabelDPSetupError(f"{ref.party} got unreadable release terms from {labels_party}")
    check_parameters(LabelDPJob.from_terms(channel, labels_party, ref.party, terms))
    return terms


@task(name="label-dp-send-id-order", task_run_name="{ref.party}: send the id order", **PARTY_STEP)
def send_id_order(channel: Channel, labels_party: str, ref: TableRef) -> None:
    """Send the labels party this table's id-order digest as soon as the job starts, before
    its terms arrive: the labels party checks alignment with it before it charges anything,
    without waiting a round trip for an answer (the digest needs only the job id)."""
    frame, _, _ = _read_features(ref)
    endpoint = channel.endpoint(ref.party)
    secure_sum.prefetch(endpoint, labels_party, "id_order_digest")  # checked after the terms
    digest = id_order_digest(channel.run, frame[ref.id_column])
    endpoint.send(labels_party, "id_order_digest", digest)


@task(name="label-dp-check-features", task_run_name="{ref.party}: check alignment", **PARTY_STEP)
def check_features(job: LabelDPJob, ref: TableRef) -> dict[str, Any]:
    """Compare the labels party's id-order digest with one's own (reveals equal or not):
    this party trains on no labels of misaligned rows."""
    frame, X, _ = _read_features(ref)
    theirs = job.endpoint(ref.party).receive(job.labels_party, "id_order_digest")
    own = id_order_digest(job.job_id, frame[ref.id_column])
    require_aligned(own, theirs, ref.party, job.labels_party, LabelDPSetupError)
    return {"rows": len(frame), "features": X.shape[1]}


def linear_form(model: Pipeline) -> tuple[np.ndarray, float]:
    """Coefficients and intercept in the features' own units (undoing the standardisation)."""
    scaler, estimator = model[0], model[-1]
    coefficients = np.asarray(estimator.coef_, dtype=float) / scaler.scale_
    return coefficients, float(estimator.intercept_ - coefficients @ scaler.mean_)


def predict(model: dict[str, Any], X: np.ndarray) -> np.ndarray:
    """Predictions of a saved model (log link for Poisson loss)."""
    record = ModelRecord.from_dict(model)
    return record.prediction(record.score(X))


@task(name="label-dp-train", task_run_name="{ref.party}: train on noisy labels", **PARTY_STEP)
def train_model(
    job: LabelDPJob, ref: TableRef, preprocessing: PreprocessingSpec | None = None
) -> dict[str, Any]:
    """Fit on own features (preprocessed with statistics of its own training rows; default:
    standardise) and the received noisy labels; save the model in own store."""
    frame, raw, raw_names = _read_features(ref)
    noisy = np.asarray(job.endpoint(ref.party).receive(job.labels_party, "noisy_labels"))
    if noisy.shape != (len(raw),):
        raise LabelDPSetupError(f"received {noisy.shape} noisy labels for {len(raw)} rows")
    train, holdout = job.train_rows(len(raw)), job.holdout_rows(len(raw))
    fitted = fit_local(raw[train], raw_names, preprocessing or PreprocessingSpec())
    X = fitted.transform(raw, f"party {ref.party}, table {ref.table!r}")
    names = fitted.output_names
    weights, intercept = linear_form(train_on_noisy_labels(X[train], noisy[train], job.loss))
    eps1, eps2 = job.split(len(X))
    record = ModelRecord.linear(
        PROTOCOL,
        job.job_id,
        names,
        weights,
        intercept,
        link="log" if job.loss == "poisson" else "identity",
        rows={"train": int(train.size), "held_out": int(holdout.size)},
        preprocessing=fitted.to_dict(),
        extras={
            "loss": job.loss,
            "mechanism": {  # public parameters, plus what the noisy labels themselves show
                **job.release_parameters(),
                "prior_epsilon": eps1,
                "label_epsilon": eps2,
                "grid_points": job.grid().size,
                "distinct_noisy_values": int(np.unique(noisy).size),
            },
        },
        **provenance(ref),
    )
    ids = frame[ref.id_column].to_numpy(dtype=object)
    models.ModelStore(PartyStore.of(ref)).save(
        model_key(job.job_id), record, ids[train], ids[holdout]
    )
    predictions = record.prediction(record.score(X))  # as predict() gives for the saved model
    metrics = {"train_loss_vs_noisy": _mean_loss(job, predictions[train], noisy[train])}
    if holdout.size:
        metrics["holdout_loss_vs_noisy"] = _mean_loss(job, predictions[holdout], noisy[holdout])
    return {
        "key": model_key(job.job_id),
        "coefficients": dict(zip(names, weights.tolist(), strict=True)),
        "intercept": intercept,
        "metrics": metrics,
        "train_rows": int(train.size),
        "holdout_rows": int(holdout.size),
    }


def _mean_loss(job: LabelDPJob, predicted: np.ndarray, label: np.ndarray) -> float:
    return float(np.mean(pointwise_loss(job.loss, predicted, label)))


@task(name="label-dp-predictions", task_run_name="{ref.party}: send predictions", **PARTY_STEP)
def send_predictions(job: LabelDPJob, ref: TableRef) -> int:
    """For ``evaluate`` only: the model's predictions on the hold-out rows (all rows if there
    is no hold-out) go to the labels party. Documented leak: they reveal the predictions."""
    frame, _, _ = _read_features(ref)
    model = ArtifactStore(PartyStore.of(ref)).get(model_key(job.job_id))
    rows, _ = job.evaluated_rows(len(frame))
    fitted = FittedPreprocessing.from_dict(model["preprocessing"])  # train_model stores it
    where = f"party {ref.party}, table {ref.table!r}"
    X = model_matrix(frame.iloc[rows], model["features"], fitted, where)
    job.endpoint(ref.party).send(job.labels_party, "predictions", predict(model, X))
    return int(rows.size)
