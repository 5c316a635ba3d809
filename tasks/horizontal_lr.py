"""Horizontal logistic regression: what both sides of a job share (its terms, the round's call,
the checkpoints, the saved model's format). Maths: :mod:`core.horizontal_lr`; the sums:
:mod:`tasks.secure_rounds`. More: docs/protocols/horizontal-lr.md."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from core import horizontal_lr as hlr
from core.dp import distributed
from core.job_schema import HorizontalOptions
from core.model_format import ModelRecord
from core.preprocessing import FittedPreprocessing
from core.secagg.weighted import packed_dimension
from storage import models
from storage.checkpoints import RoundCheckpoints
from storage.party_store import PartyStore
from tasks import secure_rounds
from tasks.preprocessing import stored_fitted
from tasks.reporting import job_name

PROTOCOL = "horizontal"


def rounds_job(
    job_id: str,
    parties: tuple[str, ...] | list[str],
    threshold: int,
    n_features: int,
    stage_timeout: float = 60.0,
) -> secure_rounds.RoundsJob:
    """The job's secure-aggregation terms: packed vector = [rows * update (n_features + 1),
    rows * loss, rows]; keys agreed once for all its rounds."""
    dimension = packed_dimension(n_features + 1)
    return secure_rounds.RoundsJob(
        PROTOCOL, job_id, tuple(parties), threshold, dimension, stage_timeout=stage_timeout
    )


def n_features(job: secure_rounds.RoundsJob) -> int:
    """The model's columns (its intercept apart), as the job's packed dimension says."""
    return job.dimension - packed_dimension(1)


@dataclass(frozen=True)
class RoundCall:
    """The coordinator's call for one round (or the stop after the last): the agreed terms and
    the round's active parties with their keys; sent once per round, never changed."""

    stop: bool  # training is over, keep the last model
    parties: tuple[str, ...]
    threshold: int
    stage_timeout: float
    training: tuple[int, float, float, float]  # :func:`training`, then the coordinator's tol
    # dropped in an earlier round and not yet back with new keys: not waited for in this
    # round; each asks to rejoin (:func:`tasks.secure_rounds_party.party_rejoin`)
    out: tuple[str, ...] = ()
    protocol: dict[str, Any] | None = None  # active parties and their keys (secure_rounds)
    dp: dict[str, Any] | None = None  # :func:`dp_terms`; None without DP

    def to_message(self) -> dict[str, Any]:
        message = {
            "stop": self.stop,
            "parties": list(self.parties),
            "threshold": self.threshold,
            "stage_timeout": self.stage_timeout,
            "out": list(self.out),
            "options": list(self.training),
            "protocol": self.protocol or {"active": [], "keys": {}},
        }
        return message if self.dp is None else {**message, "dp": self.dp}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> RoundCall:
        epochs, rate, l2, tol = message["options"]
        return cls(
            bool(message["stop"]),
            tuple(message["parties"]),
            int(message["threshold"]),
            float(message["stage_timeout"]),
            (int(epochs), float(rate), float(l2), float(tol)),
            tuple(message.get("out", ())),
            message.get("protocol"),
            message.get("dp"),
        )


def training(options: HorizontalOptions) -> tuple[int, float, float]:
    """The options every call states and every hospital checks against its own."""
    return options.local_epochs, options.learning_rate, options.l2


# ---------------------------------------------------------------------------------------------
# Distributed differential privacy (the maths: core.dp.distributed, core.horizontal_lr)

MECHANISM = "horizontal-lr distributed discrete Gaussian (zCDP calibration)"


def dp_terms(options: HorizontalOptions) -> dict[str, Any] | None:
    """What every call states and every hospital checks when the job is under DP (its noise
    is calibrated for ``rounds``, so they are a term too); None without DP."""
    if options.dp_epsilon is None:
        return None
    return {
        "epsilon": options.dp_epsilon,
        "delta": options.dp_delta,
        "clip_norm": options.dp_clip_norm,
        "colluding_parties": options.colluding_parties,
        "rounds": options.rounds,
    }


def check_dp(options: HorizontalOptions, threshold: int, pooled_statistics: bool) -> None:
    """What DP needs beyond the schema, refused before anything runs (the errors say why; also
    docs/protocols/horizontal-lr.md): one gradient a round, no pooled statistics, honest shares."""
    if options.dp_epsilon is None:
        return
    if options.local_epochs:
        raise ValueError("dp_epsilon needs local_epochs = 0 (one clipped gradient a round)")
    if pooled_statistics:
        raise ValueError(
            "dp_epsilon covers the rounds, not pooled preprocessing statistics (exact sums): "
            "standardise the tables beforehand and set preprocessing.scaling to 'none'"
        )
    distributed.honest_shares(threshold, options.colluding_parties)


def dp_clip(options: HorizontalOptions) -> float | None:
    """The per-row clip norm the round's sum is read with (:func:`core.horizontal_lr.round_mean`);
    None without DP."""
    return None if options.dp_epsilon is None else options.dp_clip_norm


def dp_noise(
    options: HorizontalOptions, job: secure_rounds.RoundsJob
) -> distributed.DistributedGaussian | None:
    """The job's noise (None without DP): sigma for all its rounds, split into ``threshold -
    colluding_parties`` shares, in the secure sum's grid steps."""
    terms = dp_terms(options)
    if terms is None:
        return None
    return _calibrated(json.dumps(terms, sort_keys=True), job.threshold, job.scale_bits,
                       job.dimension)  # fmt: skip


@functools.lru_cache(maxsize=16)
def _calibrated(
    terms: str, threshold: int, scale_bits: int, dimension: int
) -> distributed.DistributedGaussian:
    """The calibration (a bisection) once per job and process, not once per round."""
    dp = json.loads(terms)
    sensitivity = distributed.grid_sensitivity(
        hlr.dp_sensitivity(dp["clip_norm"]), scale_bits, dimension
    )
    honest = distributed.honest_shares(threshold, dp["colluding_parties"])
    return distributed.calibrate(
        dp["epsilon"], dp["delta"], sensitivity, dp["rounds"], honest, dimension
    )


def dp_release_key(table_fingerprint: str, job: secure_rounds.RoundsJob, terms: dict) -> str:
    """Names a hospital's charge for the job's rounds by its salted table digest and every
    term that shapes the noise (a retry finds it)."""
    text = json.dumps(
        {"table": table_fingerprint, "job": job.job_id, "threshold": job.threshold,
         "parties": list(job.parties), **terms},
        sort_keys=True,
    )  # fmt: skip
    return "horizontal-dp-" + hashlib.sha256(text.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Keys, checkpoints and the saved model


def checkpoints(store: PartyStore, job_id: str) -> RoundCheckpoints:
    return RoundCheckpoints(store, PROTOCOL, job_id)


def status(store: PartyStore, job_id: str) -> dict[str, Any]:
    """Last round this holder finished in the job, and that round's largest weight change."""
    cps = checkpoints(store, job_id)
    last = cps.last_round()
    change = cps.load(last).get("change") if last >= 0 else None
    return {"last_round": last, "change": change}


def model_key(job_id: str) -> str:
    return models.model_key(PROTOCOL, job_id)


def model_record(
    job_id: str,
    features: list[str],
    weights: np.ndarray,
    rounds: int,
    preprocessing: dict[str, Any] | None = None,
    origin: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The saved model in the common format from the training's ``weights`` (coefficients, then
    the intercept), its ``preprocessing`` and the holder's ``origin`` (its provenance)."""
    weights = np.asarray(weights, dtype=np.float64)
    record = ModelRecord.linear(
        PROTOCOL,
        job_id,
        features,
        weights[:-1],
        float(weights[-1]),
        preprocessing=preprocessing,
        extras={"rounds": rounds},
        **(origin or {"job": job_name()}),
    )
    return record.to_dict()


def model_weights(model: dict[str, Any]) -> np.ndarray:
    """Weight vector (coefficients in ``model['features']`` order, then intercept)."""
    coefficients = [model["coefficients"][f] for f in model["features"]]
    return np.array([*coefficients, model["intercept"]], dtype=np.float64)


def predict_proba(model: dict[str, Any], X: pd.DataFrame | np.ndarray) -> np.ndarray:
    """P(label = 1) for rows of ``X`` (a DataFrame of raw values by column name, transformed
    with the model's preprocessing, or an array already in model order and units)."""
    if isinstance(X, pd.DataFrame):
        if model.get("preprocessing") is None:
            X = X.loc[:, model["features"]]
        else:
            fitted = FittedPreprocessing.from_dict(model["preprocessing"])
            X = fitted.transform(X.loc[:, fitted.input_names].to_numpy(float))
            X = X[:, [fitted.output_names.index(f) for f in model["features"]]]
    return hlr.predict_proba(model_weights(model), np.asarray(X, dtype=np.float64))


def trained_columns(fitted: FittedPreprocessing | None, features: list[str]) -> list[str]:
    """The model's columns: the agreed ``features``, then the missing indicators the job's
    pooled statistics add (the same at every holder)."""
    return list(features) if fitted is None else fitted.output_names


def model_width(database: str, job_id: str, features: list[str]) -> int:
    """How many columns the job's model has at a holder of its pooled statistics."""
    return len(trained_columns(stored_fitted(database, job_id), features))
