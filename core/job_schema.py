"""The job file's schema: one typed model per kind of job file, checked before anything runs.

A job file is refused as a whole before any table is loaded or any message sent: unknown keys
(with the closest valid one), wrong types and values out of range, in at most five lines that
name the file and each key's path. Option names and defaults follow the flows that take them;
``tests/test_job_schema.py`` checks the two cannot drift apart.

Kinds: a *main* job (guest and host: PSI, vertical LR, WALR, sub-jobs) and three sub-jobs,
recognised by their stage key: ``label_dp`` (guest and host), ``horizontal_lr`` and
``sparse_lda`` (any number of hospitals, plus a coordinator that holds no table).
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.option_defaults import (
    DEFAULT_DIRECTION_RADIUS_SCALE,
    DEFAULT_GRID_SIZE,
    DEFAULT_RANDOMIZER,
    DEFAULT_THRESHOLD_SCALE,
    LOSS_NAMES,
    RANDOMIZER_MODES,
    PrecisionMethod,
    PrivacyUnit,
)

MAX_LINES = 5  # a refusal's lines, its first line included

Identifier = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")]
JobName = Annotated[str, Field(pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,78}[A-Za-z0-9])?$")]
Fraction = Annotated[float, Field(ge=0, lt=1)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Epsilon = Annotated[float, Field(gt=0)]
Delta = Annotated[float, Field(gt=0, lt=1)]
Cell = Union[int, float, str]  # noqa: UP007 (a JSON number or string, as a source file holds it)

Randomizer = Literal[(*RANDOMIZER_MODES, "djn")]  # type: ignore[valid-type]  # djn: short
Loss = Literal[LOSS_NAMES]  # type: ignore[valid-type]
Mechanism = Literal["rr_on_bins", "laplace", "exponential", "staircase"]
PrecisionChoice = Literal[tuple(m.value for m in PrecisionMethod)]  # type: ignore[valid-type]
UnitChoice = Literal[tuple(u.value for u in PrivacyUnit)]  # type: ignore[valid-type]


class JobFileError(ValueError):
    """A job file is refused; the message names the file, each key's path and a suggestion."""


class _Strict(BaseModel):
    """Unknown keys refused; no silent conversion ("4" is not an int, 1 is not a bool)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ---- tables and parties -------------------------------------------------------------------------
class TableDescriptor(_Strict):
    """Where a party's table lives (the fields of ``storage.descriptor.TableRef``)."""

    database: str = Field(description="the party's DuckDB file (relative: its own folder)")
    table: Identifier = Field(description="table name in that database")
    party: Identifier | None = Field(None, description="owner (default: the database's name)")
    id_column: Identifier = Field("id", description="column PSI matches on")
    label_column: Identifier | None = Field(None, description="the label, if this party has it")
    feature_columns: list[Identifier] | None = Field(
        None, description="features used (default: every other column)"
    )
    label_domain: list[float] | None = Field(
        None, description="allowed label values, e.g. [0, 1] (default: any finite number)"
    )


class PrivacyBudget(_Strict):
    """An initial budget, set at load time only where the owner has none."""

    epsilon: Epsilon = Field(description="total epsilon of the source table")
    delta: Fraction = Field(description="total delta of the source table (0 for pure DP)")


class PartyPreprocessing(_Strict):
    """What one party declares about its own columns."""

    missing_values: dict[str, list[Cell]] = Field(
        default_factory=dict, description='values read as missing, per column ("*": every column)'
    )
    categorical: dict[str, list[Cell]] = Field(
        default_factory=dict, description="one-hot columns with exactly these categories"
    )


class Preprocessing(PartyPreprocessing):
    """Job-level preprocessing, applied to every table of the job."""

    scaling: Literal["standard", "robust", "none"] = Field(
        "standard", description="standard (mean/sd), robust (median/IQR) or none"
    )
    impute: Literal["none", "mean", "median", "constant"] = Field(
        "none", description='"none" refuses a missing cell'
    )
    fill_value: float = Field(0.0, description='the value used with impute = "constant"')
    missing_indicator: bool = Field(False, description="add a <column>_missing 0/1 column")


class PartyEntry(_Strict):
    """One party's entry under ``parties``: its source file and the table it goes into."""

    source: str = Field(description="CSV, CSV.gz or Parquet file (relative: its own folder)")
    table: TableDescriptor = Field(description="the table the source is loaded into")
    privacy_budget: PrivacyBudget | None = Field(None, description="initial budget (see above)")
    preprocessing: PartyPreprocessing | None = Field(
        None, description="this party's missing values and categorical columns"
    )


class GuestHost(_Strict):
    """The two roles of a main job or a label-DP job."""

    guest: PartyEntry = Field(description="holds the labels")
    host: PartyEntry = Field(description="holds features")


# ---- stages -------------------------------------------------------------------------------------
class PsiOptions(_Strict):
    """``psi_align`` / ``psi_align_party``."""

    min_rows: int = Field(100, ge=1, description="smallest intersection either party accepts")
    protocol: Literal["kkrt", "rr22", "ecdh"] = Field(
        "rr22", description="OT extension (KKRT16), VOLE and OKVS (RR22), or X25519"
    )


class VerticalOptions(_Strict):
    """``vertical_lr`` / ``vertical_lr_party``."""

    epochs: int = Field(5, ge=1, description="passes over the training rows")
    batch_size: int = Field(1024, ge=1, description="rows per encrypted round")
    learning_rate: Positive = Field(0.15, description="step size")
    momentum: Fraction = Field(0.9, description="heavy-ball momentum")
    decay: NonNegative = Field(0.0, description="learning-rate decay per epoch")
    l2: NonNegative = Field(0.0, description="ridge penalty")
    tol: NonNegative = Field(1e-5, description="stop when the loss changes less than this")
    key_size: int = Field(2048, ge=256, description="Paillier modulus bits (< 2048: tests only)")
    seed: int = Field(0, ge=0, description="seeds the hold-out split and the batches")
    holdout_fraction: Fraction = Field(0.1, description="rows held out to score the model")
    arbiter: bool = Field(True, description="a third party holds the key (false: two-party)")
    arbiter_database: str | None = Field(None, description="the arbiter's store")
    randomizer: Randomizer = Field(DEFAULT_RANDOMIZER, description="Paillier obfuscators")
    clip_features: Positive | None = Field(None, description="clip each feature to +-this")


class WalrOptions(_Strict):
    """``walr`` / ``walr_party``."""

    epsilon: Epsilon = Field(description="label-DP epsilon of the one release")
    delta: Delta = Field(description="label-DP delta of the one release")
    mode: Literal["binary", "clipped"] = Field("clipped", description="sensitivity bound")
    clip_norm: Positive | None = Field(None, description="row norm bound for clipped mode")
    l2: NonNegative = Field(1e-3, description="ridge penalty of the fit")
    key_size: int = Field(2048, ge=256, description="Paillier modulus bits (< 2048: tests only)")
    noise: bool = Field(True, description="false only in tests: a test switch and owner consent")
    evaluate: bool = Field(False, description="score held-out rows")
    protected_table: Identifier | None = Field(None, description="table charged (default: source)")
    randomizer: Randomizer = Field(DEFAULT_RANDOMIZER, description="Paillier obfuscators")
    holdout_fraction: Fraction = Field(0.0, description="rows held out to score the model")


class LabelDPOptions(_Strict):
    """``label_dp_regression`` / ``label_dp_party``."""

    epsilon: Epsilon = Field(description="label-DP epsilon of the release")
    loss: Loss = Field("squared", description="regression loss")
    label_range: Annotated[list[float], Field(min_length=2, max_length=2)] | None = Field(
        None, description="[low, high] the labels are clipped to"
    )
    mechanism: Mechanism = Field("rr_on_bins", description="label release mechanism")
    prior_epsilon: Epsilon | None = Field(None, description="share of epsilon for the prior")
    grid_size: int = Field(DEFAULT_GRID_SIZE, ge=2, description="points of the label grid")
    integer_labels: bool = Field(False, description="labels are whole numbers")
    clip: bool = Field(True, description="clip labels to label_range")
    holdout_fraction: Fraction = Field(0.2, description="rows held out to score the model")
    seed: int = Field(0, ge=0, description="seeds the hold-out split")
    evaluate: bool = Field(False, description="score held-out rows")

    @field_validator("label_range")
    @classmethod
    def _ordered(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not value[0] < value[1]:
            raise ValueError("label_range must be [low, high] with low < high")
        return value


class HorizontalOptions(_Strict):
    """``horizontal_lr`` / ``horizontal_lr_coordinator`` / ``horizontal_lr_party``."""

    rounds: int = Field(20, ge=1, description="secure-aggregation rounds")
    local_epochs: int = Field(0, ge=0, description="local passes per round (0: one gradient)")
    learning_rate: Positive = Field(0.2, description="step size")
    l2: NonNegative = Field(1e-3, description="ridge penalty")
    tol: NonNegative = Field(1e-6, description="stop once no weight moves by more than this")
    seed: int = Field(0, ge=0, description="names a derived job id (local runs without a job file)")
    threshold: int | None = Field(None, ge=2, description="fewest parties a round accepts")
    stage_timeout: Positive = Field(60.0, description="seconds the coordinator waits per stage")
    join_timeout: Positive = Field(600.0, description="seconds it waits for parties to join")
    holdout_fraction: Fraction = Field(0.0, description="rows each party holds out")
    dp_epsilon: Epsilon | None = Field(
        None, description="distributed DP: epsilon of all rounds for each row (omit: no DP)"
    )
    dp_delta: Delta = Field(1e-5, description="distributed DP: delta of all rounds")
    dp_clip_norm: Positive = Field(1.0, description="distributed DP: each row's gradient bound")
    colluding_parties: int = Field(
        0, ge=0, description="distributed DP: hospitals that may pool their noise shares"
    )


class SparseLDAOptions(_Strict):
    """``sparse_lda`` / ``sparse_lda_coordinator`` / ``sparse_lda_party``."""

    epsilon: Epsilon = Field(description="epsilon each party's table is charged")
    delta: Delta = Field(description="delta each party's table is charged")
    direction_clip_norm: Positive | None = Field(None, description="party unit: direction bound")
    mean_clip_norm: Positive | None = Field(None, description="party unit: class-mean bound")
    method: Literal["debiased", "naive", "centralized_reference"] = Field(
        "debiased", description="party unit: how local fits combine"
    )
    privacy_unit: UnitChoice = Field("row", description="what one release protects")
    row_clip_norm: Positive | None = Field(None, description="row unit: row norm bound")
    holdout_fraction: Fraction = Field(0.0, description="rows each party holds out")
    lambda_scale: Positive = Field(DEFAULT_DIRECTION_RADIUS_SCALE, description="Dantzig radius")
    precision_method: PrecisionChoice = Field("nodewise_lasso", description="precision estimate")
    hard_threshold_scale: Positive = Field(DEFAULT_THRESHOLD_SCALE, description="support cut")
    hard_threshold_noise_multiplier: Positive | None = Field(None, description="cut vs noise")
    colluding_parties: int = Field(0, ge=0, description="parties assumed to collude")
    threshold: int | None = Field(None, ge=2, description="fewest parties a release accepts")
    stage_timeout: Positive = Field(60.0, description="seconds the coordinator waits per stage")
    join_timeout: Positive = Field(600.0, description="seconds it waits for parties to join")


class ScoreOptions(_Strict):
    """``score_vertical`` / ``score_vertical_party``."""

    model_job: JobName = Field(description="the job whose promoted vertical model scores")
    min_rows: int = Field(1, ge=1, description="fewest shared new rows scored")


class SubJobs(_Strict):
    """Sub-job files run after the main job, in the order written."""

    label_dp: str | None = Field(None, description="a label-DP job file")
    horizontal_lr: str | None = Field(None, description="a horizontal LR job file")
    sparse_lda: str | None = Field(None, description="a sparse LDA job file")
    score_vertical: str | None = Field(None, description="a vertical scoring job file")


# ---- job files ----------------------------------------------------------------------------------
class _Job(_Strict):
    job: JobName | None = Field(None, description="names the job's ids (default: file name)")
    description: str | None = Field(None, description="free text")
    preprocessing: Preprocessing | None = Field(None, description="applies to every table")
    restart_grace: float = Field(
        600.0,
        gt=0,
        description="seconds every party waits for a party that went down to restart before "
        "the job ends for all (party mode)",
    )


class MainJob(_Job):
    """``privreg run`` / ``pipeline``: PSI, then vertical LR and WALR, then the sub-jobs."""

    parties: GuestHost = Field(description="guest (labels) and host (features)")
    psi: PsiOptions = Field(default_factory=PsiOptions, description="the alignment")
    vertical: VerticalOptions | None = Field(None, description="vertical LR (omit: not run)")
    walr: WalrOptions | None = Field(None, description="WALR (omit: not run)")
    subjobs: SubJobs | None = Field(None, description="sub-job files (omit: none)")


class LabelDPJob(_Job):
    """Sub-job ``label_dp``: the guest's labels released under label DP to the host."""

    parties: GuestHost = Field(description="guest (labels) and host (features)")
    psi: PsiOptions = Field(default_factory=PsiOptions, description="the alignment")
    label_dp: LabelDPOptions = Field(description="the release and the regression")


class HospitalsJob(_Job):
    """Base of the sub-jobs whose parties hold the same columns (a coordinator has no table)."""

    parties: Annotated[dict[Identifier, PartyEntry], Field(min_length=2)] = Field(
        description="two or more parties by name"
    )


class HorizontalJob(HospitalsJob):
    """Sub-job ``horizontal_lr``: parties holding the same columns train one logistic
    regression; the coordinator sees only securely aggregated sums."""

    horizontal_lr: HorizontalOptions = Field(
        default_factory=HorizontalOptions, description="the training"
    )


class SparseLDAJob(HospitalsJob):
    """Sub-job ``sparse_lda``: parties holding the same columns fit one sparse discriminant
    from noisy, securely summed statistics."""

    sparse_lda: SparseLDAOptions = Field(description="the release and the fit")


class ScoreVerticalJob(_Job):
    """Sub-job ``score_vertical``: new rows of the guest and the host scored with the vertical
    model a job trained and promoted (each party's own share; the guest stores the scores)."""

    parties: GuestHost = Field(description="guest (its new rows, the scores) and host")
    score_vertical: ScoreOptions = Field(description="which model, and the alignment")


KINDS: dict[str, type[_Job]] = {
    "main": MainJob,
    "label_dp": LabelDPJob,
    "horizontal_lr": HorizontalJob,
    "sparse_lda": SparseLDAJob,
    "score_vertical": ScoreVerticalJob,
}
SUB_JOBS = tuple(kind for kind in KINDS if kind != "main")


def job_kind(data: dict[str, Any]) -> str:
    """A sub-job file is recognised by its stage key; any other file is a main job."""
    found = [kind for kind in SUB_JOBS if kind in data]
    if len(found) > 1:
        raise ValueError(f"holds the stages of {len(found)} sub-jobs {found}; keep one per file")
    return found[0] if found else "main"


def validate_job(data: Any, file: str | Path, kind: str | None = None) -> _Job:
    """The job file's content as its typed model, or a :class:`JobFileError` naming ``file``."""
    if not isinstance(data, dict):
        raise JobFileError(f"job file {file} must hold a JSON object, not {type(data).__name__}")
    try:
        found = job_kind(data)
    except ValueError as error:
        raise JobFileError(f"job file {file} {error}") from None
    if kind is not None and found != kind:
        hint = f" (run it alone with `privreg run {file}`)" if found != "main" else ""
        raise JobFileError(
            f"job file {file} is a {_kind_name(found)} file where a {_kind_name(kind)} file "
            f"is expected{hint}"
        )
    try:
        return KINDS[found].model_validate(data)
    except ValidationError as error:
        raise JobFileError(_refusal(file, found, error)) from None


def _kind_name(kind: str) -> str:
    return "main job" if kind == "main" else f"{kind} sub-job"


@dataclass(frozen=True)
class _Problem:
    """One refused key: its path, what is wrong, and the key probably meant (if any)."""

    path: tuple[str, ...]
    text: str
    meant: str | None = None

    def line(self) -> str:
        return f"{'.'.join(self.path) or '(top level)'}: {self.text}"


def _refusal(file: str | Path, kind: str, error: ValidationError) -> str:
    problems = [_problem(KINDS[kind], e) for e in error.errors()]
    # "parties.host: missing" says nothing more than "parties.hots: ... did you mean 'host'?"
    meant = {(*p.path[:-1], p.meant) for p in problems if p.meant}
    lines = [p.line() for p in problems if not (p.text.startswith("missing") and p.path in meant)]
    shown = lines[: MAX_LINES - 1]
    if len(lines) > len(shown):  # the last line says how many more
        shown = [*lines[: MAX_LINES - 2], f"... and {len(lines) - MAX_LINES + 2} more"]
    head = f"job file {file} ({_kind_name(kind)}) is refused:"
    return "\n".join([head, *(f"  {line}" for line in shown)])


def _problem(model: type[BaseModel], error: Any) -> _Problem:
    loc = tuple(str(p) for p in error["loc"] if not str(p).startswith(("function-", "lax-")))
    if error["type"] == "extra_forbidden":
        valid = _keys_at(model, list(loc[:-1]))
        if not loc[:-1]:  # a top-level typo may be any kind's stage key
            valid = sorted(set(valid) | set(SUB_JOBS))
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
        what = "role" if loc[:-1] == ("parties",) else "key"
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(valid)}"
        if loc[-2:-1] == ("preprocessing",) and loc[-1] in Preprocessing.model_fields:
            hint = "; a party may set only missing_values and categorical (the rest: job level)"
        return _Problem(loc, f"unknown {what} {loc[-1]!r}{hint}", close[0] if close else None)
    if error["type"] == "missing":
        return _Problem(loc, "missing (required)")
    message = error["msg"][0].lower() + error["msg"][1:]
    return _Problem(loc, f"{message}, got {error['input']!r}")


def _keys_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The valid keys of the object at ``loc`` (a dict's keys are free, so none follow it)."""
    annotation: Any = model
    for part in loc:
        annotation = bare_type(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            if field is None:
                return []
            annotation = field.annotation
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return []
    annotation = bare_type(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def bare_type(annotation: Any) -> Any:
    """``X | None`` and ``Annotated[X, ...]`` as ``X``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation
