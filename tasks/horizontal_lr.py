"""Horizontal logistic regression with secure aggregation: what both sides of a job share.

The maths is in :mod:`core.horizontal_lr` (the model) and :mod:`core.secagg.multiround` (the
masking, keys agreed once per job), wired to the stores and the channel by
:mod:`tasks.secure_rounds`. A hospital's steps are :mod:`tasks.horizontal_party`, the
coordinator's :mod:`tasks.horizontal_coordinator`; each side opens only its own store and
endpoint (the coordinator is a logical party with its own store). Here: the job's terms, the
round's call, the round checkpoints and the saved model's format.

Tasks do not use Prefect's result cache (``NO_CACHE``): resuming is done by the parties' own
round checkpoints, so nothing a party computes is kept in the orchestrator's result storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from core import horizontal_lr as hlr
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
    """The coordinator's call for one round (or the stop after the last): what every holder
    must agree on before it contributes, and the round's active parties with their public
    keys. Sent once per round and never changed (a restarted coordinator re-sends it)."""

    stop: bool  # training is over, keep the last model
    parties: tuple[str, ...]
    threshold: int
    stage_timeout: float
    training: tuple[int, float, float, float]  # :func:`training`, then the coordinator's tol
    # dropped in an earlier round and not yet back with new keys: not waited for in this
    # round; each asks to rejoin (:func:`tasks.secure_rounds_party.party_rejoin`)
    out: tuple[str, ...] = ()
    protocol: dict[str, Any] | None = None  # active parties and their keys (secure_rounds)

    def to_message(self) -> dict[str, Any]:
        return {
            "stop": self.stop,
            "parties": list(self.parties),
            "threshold": self.threshold,
            "stage_timeout": self.stage_timeout,
            "out": list(self.out),
            "options": list(self.training),
            "protocol": self.protocol or {"active": [], "keys": {}},
        }

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
        )


def training(options: HorizontalOptions) -> tuple[int, float, float]:
    """The options every call states and every hospital checks against its own."""
    return options.local_epochs, options.learning_rate, options.l2


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
    """The saved model in the common format (``core.model_format``): ``weights`` is the
    training's vector, coefficients then the intercept. With ``preprocessing`` (the pooled
    statistics it was trained with) scoring applies them; ``origin`` is the holder's
    :func:`tasks.reporting.provenance` (its job and the digest of its table)."""
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
    """The model's columns: the agreed ``features``, then a ``<name>_missing`` indicator for
    each column the job's pooled statistics flag (``missing_indicator``); the same at every
    holder, since all keep the same statistics."""
    return list(features) if fitted is None else fitted.output_names


def model_width(database: str, job_id: str, features: list[str]) -> int:
    """How many columns the job's model has at a holder of its pooled statistics (read from
    its store once per side, before the first round)."""
    return len(trained_columns(stored_fitted(database, job_id), features))
