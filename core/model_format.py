"""The one shape every flow saves a model in, so a person can read, export and score any of them.

A linear model is ``score = X @ coefficients + intercept`` on the features after the stored
preprocessing (imputation, scaling, then clipping to ``[-clip, clip]``); ``link`` says what the
score means (``logit``: a log-odds, ``identity`` / ``log``: a regression's mean or its log,
``discriminant``: positive predicts label 1). A model split across parties (vertical LR) is
saved as one *share* per party: the features and coefficients that party holds, with the
intercept at the guest only; no share is a whole model, and :meth:`ModelRecord.score` refuses
one without its peers' score shares.

Flow-specific values (rounds run, a release's parameters, a discriminant's class means) are
``extras``: they sit beside the common fields in the stored dict, never instead of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

import numpy as np

__all__ = ["FLOWS", "FORMAT_VERSION", "LINKS", "ModelFormatError", "ModelRecord", "utc_now"]

FORMAT_VERSION = 1
#: The flows that save models, as they are named in model keys.
FLOWS = ("vertical", "horizontal", "walr", "label_dp", "sparse_lda")
LINKS = ("logit", "identity", "log", "discriminant")


class ModelFormatError(ValueError):
    """A model record is malformed or not in the common format (bad input)."""


def utc_now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def _plain(value: Any) -> Any:
    """JSON-friendly copy (numpy arrays and scalars become lists and numbers)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class ModelRecord:
    """One saved model (or one party's share of a split model)."""

    flow: str
    job_id: str
    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    intercept: float | None  # None only on a share without it (a vertical host's)
    link: str = "logit"
    party: str | None = None  # who holds this record; set for a share
    share: bool = False  # True: this party's part of a model split across parties
    job: str = ""  # the readable job it belongs to (the job file's name)
    preprocessing: dict[str, Any] | None = None  # core.preprocessing.FittedPreprocessing
    clip: float | None = None  # features clipped to [-clip, clip] after preprocessing
    fingerprints: dict[str, str] = field(default_factory=dict)  # table -> salted digest
    rows: dict[str, int] = field(default_factory=dict)  # {"train": n, "held_out": m}
    created: str = field(default_factory=utc_now)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"{self.flow} model of job {self.job_id}"
        if self.flow not in FLOWS:
            raise ModelFormatError(f"{where}: unknown flow (one of {', '.join(FLOWS)})")
        if self.link not in LINKS:
            raise ModelFormatError(f"{where}: unknown link {self.link!r}")
        if len(self.features) != len(self.coefficients):
            raise ModelFormatError(
                f"{where}: {len(self.features)} features but {len(self.coefficients)} "
                "coefficients (the intercept is its own field)"
            )
        if "intercept" in self.features or len(set(self.features)) != len(self.features):
            raise ModelFormatError(f"{where}: feature names must be unique and not 'intercept'")
        if self.intercept is None and not self.share:
            raise ModelFormatError(f"{where}: a whole model needs an intercept")
        if self.share and not self.party:
            raise ModelFormatError(f"{where}: a share must name the party holding it")
        if not all(math.isfinite(c) for c in self.coefficients):
            raise ModelFormatError(f"{where}: a coefficient is not finite")
        clash = sorted(set(self.extras) & ({f.name for f in fields(self)} | {"format"}))
        if clash:
            raise ModelFormatError(f"{where}: extras may not reuse the names {clash}")

    # ---- building ------------------------------------------------------------------------------
    @classmethod
    def linear(
        cls,
        flow: str,
        job_id: str,
        features: list[str] | tuple[str, ...],
        coefficients: Any,
        intercept: float | None,
        **options: Any,
    ) -> ModelRecord:
        """A record from a coefficient vector (numpy or list), in ``features`` order."""
        values = tuple(float(c) for c in np.asarray(coefficients, dtype=np.float64).ravel())
        return cls(
            flow,
            job_id,
            tuple(str(f) for f in features),
            values,
            None if intercept is None else float(intercept),
            **options,
        )

    # ---- the stored dict and JSON --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The stored and exported shape: common fields first, then the flow's extras;
        ``coefficients`` maps feature to coefficient (``features`` keeps their order)."""
        common = {
            "format": FORMAT_VERSION,
            "flow": self.flow,
            "job": self.job,
            "job_id": self.job_id,
            "party": self.party,
            "share": self.share,
            "features": list(self.features),
            "coefficients": dict(zip(self.features, self.coefficients, strict=True)),
            "intercept": self.intercept,
            "link": self.link,
            "preprocessing": self.preprocessing,
            "clip": self.clip,
            "fingerprints": dict(self.fingerprints),
            "rows": dict(self.rows),
            "created": self.created,
        }
        return {**common, **self.extras}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> ModelRecord:
        if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
            raise ModelFormatError(
                "not a model in the common format (format "
                f"{record.get('format') if isinstance(record, dict) else None!r}, expected "
                f"{FORMAT_VERSION}); retrain it, or export it with the version that saved it"
            )
        names = {f.name for f in fields(cls)} - {"extras", "coefficients"}
        missing = sorted(n for n in names | {"coefficients"} if n not in record)
        if missing:
            raise ModelFormatError(f"model record lacks {missing}")
        coefficients = record["coefficients"]
        features = [str(f) for f in record["features"]]
        if not isinstance(coefficients, dict) or list(coefficients) != features:
            raise ModelFormatError("model record: coefficients must map each feature, in order")
        extras = {k: v for k, v in record.items() if k not in names | {"coefficients", "format"}}
        common = {n: record[n] for n in names}
        common["features"] = tuple(features)
        values = tuple(float(v) for v in coefficients.values())
        return cls(coefficients=values, extras=extras, **common)

    def to_json(self) -> str:
        return json.dumps(_plain(self.to_dict()), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelRecord:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as error:
            raise ModelFormatError(f"model JSON is not readable: {error}") from None

    # ---- scoring -------------------------------------------------------------------------------
    def input_columns(self) -> list[str]:
        """The table columns scoring reads: the stored preprocessing's inputs (it derives the
        features from them: indicators, one-hot columns), else the features themselves; so a
        table can be checked before anything is scored."""
        if self.preprocessing is None:
            return list(self.features)
        from core.preprocessing import FittedPreprocessing  # pandas: only for such a model

        return FittedPreprocessing.from_dict(self.preprocessing).input_names

    def share_scores(self, X: np.ndarray) -> np.ndarray:
        """``X @ coefficients`` (plus the intercept when this record holds it): the whole
        score of a whole model, or this party's share of a split one."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != len(self.features):
            raise ModelFormatError(
                f"{self.flow} model of job {self.job_id}: expected {len(self.features)} feature "
                f"columns, got shape {X.shape}"
            )
        return X @ np.asarray(self.coefficients, dtype=np.float64) + (self.intercept or 0.0)

    def score(self, X: np.ndarray) -> np.ndarray:
        """The model's score of each row (see the module's docstring for its meaning)."""
        if self.share:
            raise ModelFormatError(
                f"{self.flow} model of job {self.job_id} at {self.party} is one party's share; "
                "its peers' score shares are needed (score_vertical)"
            )
        return self.share_scores(X)

    def prediction(self, scores: np.ndarray) -> np.ndarray:
        """The score mapped through the link: a probability (logit), a mean (identity, log)
        or a 0/1 label (discriminant)."""
        scores = np.asarray(scores, dtype=np.float64)
        if self.link == "logit":
            return 1.0 / (1.0 + np.exp(-scores))
        if self.link == "log":
            return np.exp(scores)
        if self.link == "discriminant":
            return (scores > 0).astype(np.float64)
        return scores
