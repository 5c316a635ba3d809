"""Feature preprocessing: what the job declares, the statistics it needs, the transform.

A job's ``"preprocessing"`` object (and a party's own ``missing_values`` / ``categorical``)
becomes a :class:`PreprocessingSpec`. Three steps use it, all plain functions here:

* at load time, :func:`prepare_raw` reads the declared disguised missing values (``"?"``, a
  cholesterol of ``0``) as missing and one-hot encodes declared categorical columns with
  exactly the listed categories, so the stored table is numeric with NaN where a cell is
  missing;
* before training, the statistics are fitted: :func:`fit_local` on one party's own columns
  (vertical: nothing leaves the party), or :func:`fit_pooled` from the sum over parties of
  :func:`moments` (count, sum, sum of squares per column) and, for medians and quartiles, of
  :func:`histogram` counts on a public grid (horizontal: the sums go through secure
  aggregation, so only pooled totals are seen);
* :meth:`FittedPreprocessing.transform` imputes, adds missing indicators and scales; the
  fitted statistics are saved with the model so scoring applies the same transform.

Scaling statistics are computed on the observed cells of each column; imputed cells then take
the fill value. A column that is constant where observed is centred and left unscaled. Any
finite column has finite statistics: a party's own are computed on the column shifted by the
binary exponent of its largest value (exact), so a column of values near 1e308 is scaled like
the same column divided by 1e300. A statistic or a scaled cell that is still not a finite
number is refused, never passed on as inf or NaN (a load refuses a column whose values lie
further apart than the largest float: ``storage.validation``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

SCALINGS = ("standard", "robust", "none")
IMPUTES = ("none", "mean", "median", "constant")
ALL_COLUMNS = "*"
#: Bins of the public histogram grid per column (plus one below and one above it).
HISTOGRAM_BINS = 1024
#: The grid spans the pooled mean +- this many pooled standard deviations.
HISTOGRAM_SPAN = 8.0
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_]+")


class PreprocessingError(ValueError):
    """A preprocessing declaration or a table it is applied to is not usable; says where."""


def _values(data: Any, what: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise PreprocessingError(f"preprocessing.{what} must map column names to value lists")
    out = []
    for column, values in data.items():
        if not isinstance(values, list | tuple) or not all(
            isinstance(v, int | float | str) and not isinstance(v, bool) for v in values
        ):
            raise PreprocessingError(
                f"preprocessing.{what}[{column!r}] must be a list of numbers or strings"
            )
        out.append((str(column), tuple(values)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class PreprocessingSpec:
    """What a job asks for; the defaults standardise and refuse missing cells."""

    scaling: str = "standard"
    impute: str = "none"
    fill_value: float = 0.0
    missing_indicator: bool = False
    missing_values: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    categorical: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise PreprocessingError(
                f"preprocessing.scaling {self.scaling!r} is not one of {', '.join(SCALINGS)}"
            )
        if self.impute not in IMPUTES:
            raise PreprocessingError(
                f"preprocessing.impute {self.impute!r} is not one of {', '.join(IMPUTES)}"
            )
        if not math.isfinite(float(self.fill_value)):
            raise PreprocessingError("preprocessing.fill_value must be a finite number")
        for column, categories in self.categorical:
            if len(categories) < 2 or len({str(c) for c in categories}) != len(categories):
                raise PreprocessingError(
                    f"preprocessing.categorical[{column!r}] needs at least two distinct categories"
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | PreprocessingSpec | None) -> PreprocessingSpec:
        """The spec of a job file's ``"preprocessing"`` object (None: the defaults)."""
        if isinstance(data, PreprocessingSpec):
            return data
        data = dict(data or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PreprocessingError(
                f"unknown preprocessing keys {unknown}; known: {', '.join(sorted(known))}"
            )
        return cls(
            scaling=str(data.get("scaling", "standard")),
            impute=str(data.get("impute", "none")),
            fill_value=float(data.get("fill_value", 0.0)),
            missing_indicator=bool(data.get("missing_indicator", False)),
            missing_values=_values(data.get("missing_values"), "missing_values"),
            categorical=_values(data.get("categorical"), "categorical"),
        )

    def with_party(self, party: Mapping[str, Any] | None) -> PreprocessingSpec:
        """This spec plus a party's own ``missing_values`` and ``categorical`` (its columns)."""
        if not party:
            return self
        other = set(party) - {"missing_values", "categorical"}
        if other:
            raise PreprocessingError(
                f"a party's preprocessing may only set missing_values and categorical, not "
                f"{sorted(other)}"
            )
        missing = dict(self.missing_values) | dict(_values(party.get("missing_values"), "x"))
        categorical = dict(self.categorical) | dict(_values(party.get("categorical"), "x"))
        return replace(
            self,
            missing_values=tuple(sorted(missing.items())),
            categorical=tuple(sorted(categorical.items())),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "scaling": self.scaling,
            "impute": self.impute,
            "fill_value": float(self.fill_value),
            "missing_indicator": bool(self.missing_indicator),
            "missing_values": {c: list(v) for c, v in self.missing_values},
            "categorical": {c: list(v) for c, v in self.categorical},
        }

    def missing_for(self, column: str) -> tuple[Any, ...]:
        declared = dict(self.missing_values)
        return (*declared.get(ALL_COLUMNS, ()), *declared.get(column, ()))


# ---- load time: disguised missing values and categories ----------------------------------------
def _matches(raw: pd.Series, values: Sequence[Any]) -> np.ndarray:
    """Cells of ``raw`` equal to one of ``values``: numbers compare as numbers, text as text."""
    hit = np.zeros(len(raw), dtype=bool)
    numbers = [float(v) for v in values if not isinstance(v, str)]
    texts = {str(v).strip() for v in values}
    if numbers:
        numeric = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
        hit |= np.isin(numeric, numbers)
    if texts:
        hit |= raw.astype(str).str.strip().isin(texts).to_numpy() & raw.notna().to_numpy()
    return hit


def category_column(column: str, category: Any) -> str:
    """The one-hot column of ``category`` (``cp`` and 3 -> ``cp_3``), a plain identifier."""
    text = _NAME_CHARS.sub("_", str(category).strip()).strip("_") or "blank"
    return f"{column}_{text}"


def prepare_raw(
    frame: pd.DataFrame, spec: PreprocessingSpec, keep: Sequence[str], table: str
) -> pd.DataFrame:
    """``frame`` with declared missing values as NaN and categorical columns one-hot encoded.

    Columns in ``keep`` (the id and the label) are left as they are. A categorical value not
    among the listed categories is refused naming the table, column, first row and value.
    """
    if not spec.missing_values and not spec.categorical:
        return frame
    out = frame.copy()
    for column in out.columns:
        if column in keep:
            continue
        markers = spec.missing_for(str(column))
        if markers:
            hit = _matches(out[column], markers)
            if hit.any():
                out[column] = out[column].astype(object).where(~hit, np.nan)
    for column, categories in spec.categorical:
        if column not in out.columns:
            raise PreprocessingError(
                f"table {table!r}: categorical column {column!r} is not in the table"
            )
        raw = out[column]
        present = raw.notna().to_numpy()
        indicators = {category_column(column, c): _matches(raw, [c]) for c in categories}
        known = np.logical_or.reduce(list(indicators.values()))
        unknown = present & ~known
        if unknown.any():
            row = int(np.flatnonzero(unknown)[0])
            value = raw.iloc[row]
            value = value.item() if hasattr(value, "item") else value
            raise PreprocessingError(
                f"table {table!r}, column {column!r}, row {row + 1}: value "
                f"{value!r} is not one of the declared categories "
                f"{list(categories)} (preprocessing.categorical)"
            )
        position = list(out.columns).index(column)
        encoded = {
            name: np.where(present, hit.astype(float), np.nan) for name, hit in indicators.items()
        }
        left, right = out.iloc[:, :position], out.iloc[:, position + 1 :]
        out = pd.concat([left, pd.DataFrame(encoded, index=out.index), right], axis=1)
    return out


# ---- missing cells: one report of every column -------------------------------------------------
@dataclass(frozen=True)
class MissingColumn:
    column: str
    count: int
    first_row: int  # 1-based


def missing_columns(X: np.ndarray, names: Sequence[str]) -> list[MissingColumn]:
    """Every column of ``X`` with missing (NaN) cells, its count and its first row."""
    out = []
    missing = np.isnan(X)
    for j in np.flatnonzero(missing.any(axis=0)):
        rows = np.flatnonzero(missing[:, j])
        out.append(MissingColumn(str(names[j]), len(rows), int(rows[0]) + 1))
    return out


def missing_message(where: str, columns: Sequence[MissingColumn], rows: int) -> str:
    """One line naming every column with missing cells and the option that imputes them."""
    listed = "; ".join(
        f"column {c.column!r}: {c.count} of {rows} rows (first row {c.first_row})" for c in columns
    )
    return (
        f"{where}: missing (null/NaN) values in {len(columns)} column(s): {listed}. "
        "Set preprocessing.impute (mean, median or constant) in the job to fill them, and "
        "preprocessing.missing_values for values such as '?' that mean missing"
    )


# ---- statistics ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColumnStats:
    """One column's fitted transform: ``(fill-if-missing(x) - center) / scale``."""

    name: str
    center: float
    scale: float
    fill: float | None  # None: no imputation, a missing cell is refused
    missing: int  # missing cells seen when fitted (pooled over parties where pooled)
    indicator: bool  # a <name>_missing 0/1 column follows the features


@dataclass(frozen=True)
class FittedPreprocessing:
    """The spec and each column's statistics; travels with the model."""

    spec: PreprocessingSpec
    columns: tuple[ColumnStats, ...]
    rows: int

    @property
    def input_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def output_names(self) -> list[str]:
        return self.input_names + [f"{c.name}_missing" for c in self.columns if c.indicator]

    def transform(self, X: np.ndarray, where: str = "table") -> np.ndarray:
        """Impute, append missing indicators, scale; refuses missing cells it may not fill."""
        X = np.asarray(X, dtype=float)
        if X.ndim != 2 or X.shape[1] != len(self.columns):
            raise PreprocessingError(
                f"{where}: {X.shape[-1]} columns, the fitted preprocessing has "
                f"{len(self.columns)} ({', '.join(self.input_names)})"
            )
        missing = np.isnan(X)
        refused = [
            c
            for c in missing_columns(X, self.input_names)
            if self.columns[self.input_names.index(c.column)].fill is None
        ]
        if refused:
            raise PreprocessingError(missing_message(where, refused, len(X)))
        fills = np.array([0.0 if c.fill is None else c.fill for c in self.columns])
        filled = np.where(missing, fills, X)
        if not np.isfinite(filled).all():
            raise PreprocessingError(f"{where}: infinite feature values cannot be scaled")
        scaled = self._scaled(filled, where)
        flags = [j for j, c in enumerate(self.columns) if c.indicator]
        return np.hstack([scaled, missing[:, flags].astype(float)]) if flags else scaled

    def _scaled(self, filled: np.ndarray, where: str) -> np.ndarray:
        """``(x - center) / scale`` per column, refusing a cell that is not a finite number.

        A cell whose difference overflows (a new row's -1e308 against a centre of 1e308) is
        computed as ``x / scale - center / scale`` instead; one still beyond the largest float
        is refused naming its column and row, since an infinite feature would silently decide
        the score.
        """
        centers = np.array([c.center for c in self.columns])
        scales = np.array([c.scale for c in self.columns])
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = (filled - centers) / scales
            rows, cols = np.nonzero(~np.isfinite(scaled))
            scaled[rows, cols] = filled[rows, cols] / scales[cols] - centers[cols] / scales[cols]
        bad = np.argwhere(~np.isfinite(scaled))
        if len(bad):
            row, j = (int(v) for v in bad[0])
            column = self.columns[j]
            raise PreprocessingError(
                f"{where}, column {column.name!r}, row {row + 1}: value {filled[row, j]:g} "
                f"scaled by the fitted statistics (centre {column.center:g}, scale "
                f"{column.scale:g}) is beyond the largest float; divide the column by a power "
                "of ten in the source files and train again"
            )
        return scaled

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "rows": int(self.rows),
            "columns": [
                {
                    "name": c.name,
                    "center": float(c.center),
                    "scale": float(c.scale),
                    "fill": None if c.fill is None else float(c.fill),
                    "missing": int(c.missing),
                    "indicator": bool(c.indicator),
                }
                for c in self.columns
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FittedPreprocessing:
        columns = tuple(
            ColumnStats(
                str(c["name"]),
                float(c["center"]),
                float(c["scale"]),
                None if c["fill"] is None else float(c["fill"]),
                int(c["missing"]),
                bool(c["indicator"]),
            )
            for c in data["columns"]
        )
        return cls(PreprocessingSpec.from_dict(data["spec"]), columns, int(data["rows"]))


@dataclass(frozen=True)
class ColumnSummary:
    """What fitting needs of one column: observed count, mean, std and three quartiles."""

    count: int
    mean: float
    std: float
    quartiles: tuple[float, float, float] | None = field(default=None)


def _column(summary: ColumnSummary, name: str, rows: int, spec: PreprocessingSpec) -> ColumnStats:
    if summary.count == 0 and (spec.impute in ("mean", "median") or spec.scaling != "none"):
        raise PreprocessingError(f"column {name!r} has no observed value to fit on")
    needs_quartiles = spec.scaling == "robust" or spec.impute == "median"
    if needs_quartiles and summary.quartiles is None:
        raise PreprocessingError(f"column {name!r}: quartiles are needed but were not computed")
    q1, median, q3 = summary.quartiles or (math.nan, math.nan, math.nan)
    center, scale = 0.0, 1.0
    if spec.scaling == "standard":
        center, scale = summary.mean, summary.std
    elif spec.scaling == "robust":
        center, scale = median, q3 - q1
    fill = {"none": None, "mean": summary.mean, "median": median, "constant": spec.fill_value}[
        spec.impute
    ]
    _require_finite(name, center=center, scale=scale, fill=fill)
    if not scale > 1e-12 * max(1.0, abs(center)):
        scale = 1.0  # constant where observed: centred, not blown up
    missing = rows - summary.count
    return ColumnStats(name, center, scale, fill, missing, spec.missing_indicator and missing > 0)


def _require_finite(name: str, **statistics: float | None) -> None:
    """Refuses a fitted statistic that is inf or NaN (a pooled sum of squares that overflowed):
    a scale of inf would silently turn the column into zeros, a NaN one into nothing."""
    bad = [
        what for what, value in statistics.items() if value is not None and not math.isfinite(value)
    ]
    if bad:
        raise PreprocessingError(
            f"column {name!r}: its fitted {' and '.join(bad)} is not a finite number (its values "
            "are too large to sum or square); divide the column by a power of ten in the source"
        )


def fit(
    summaries: Sequence[ColumnSummary], names: Sequence[str], rows: int, spec: PreprocessingSpec
) -> FittedPreprocessing:
    """The fitted transform from per-column summaries (local or pooled)."""
    columns = tuple(_column(s, n, rows, spec) for s, n in zip(summaries, names, strict=True))
    return FittedPreprocessing(spec, columns, rows)


def fit_local(X: np.ndarray, names: Sequence[str], spec: PreprocessingSpec) -> FittedPreprocessing:
    """Statistics of one party's own columns (observed cells; population standard deviation)."""
    X = np.asarray(X, dtype=float)
    quartiles = spec.scaling == "robust" or spec.impute == "median"
    summaries = [_summary(X[~np.isnan(X[:, j]), j], quartiles) for j in range(X.shape[1])]
    return fit(summaries, names, len(X), spec)


def _summary(observed: np.ndarray, quartiles: bool) -> ColumnSummary:
    """One column's count, mean and std, computed on the column shifted by the binary exponent
    of its largest value, then shifted back (and its quartiles).

    Why: the sum of a column near 1e308 overflows, and so does a square of any value beyond
    1e154; shifted into (-1, 1) neither can, and a shift by a power of two is exact, so an
    ordinary column's statistics are the very same bits as without it. Quartiles need no
    shift (they interpolate between two values, which overflows only for a column spanning
    more than the largest float, refused at load) and keep the precision of tiny values.
    """
    if len(observed) == 0:
        return ColumnSummary(0, math.nan, math.nan)
    shift = math.frexp(float(np.max(np.abs(observed))))[1]
    unit = np.ldexp(observed, -shift)
    mean, std = (math.ldexp(float(v), shift) for v in (unit.mean(), unit.std()))
    q = tuple(float(v) for v in np.percentile(observed, [25, 50, 75])) if quartiles else None
    return ColumnSummary(len(observed), mean, std, q)


# ---- pooled statistics from summed vectors -----------------------------------------------------
def moments(X: np.ndarray) -> np.ndarray:
    """One party's [observed count | sum | sum of squares] per column, for a secure sum."""
    X = np.asarray(X, dtype=float)
    observed = ~np.isnan(X)
    values = np.where(observed, X, 0.0)
    return np.concatenate([observed.sum(axis=0), values.sum(axis=0), (values**2).sum(axis=0)])


@dataclass(frozen=True)
class PooledMoments:
    """Pooled observed count, mean and (population) variance per column."""

    count: np.ndarray
    mean: np.ndarray
    variance: np.ndarray

    @classmethod
    def from_sum(cls, total: np.ndarray, columns: int) -> PooledMoments:
        total = np.asarray(total, dtype=float)
        if total.shape != (3 * columns,):
            raise PreprocessingError(f"expected {3 * columns} summed moments, got {total.shape}")
        count = np.rint(total[:columns])
        safe = np.maximum(count, 1.0)
        mean = total[columns : 2 * columns] / safe
        variance = np.maximum(total[2 * columns :] / safe - mean**2, 0.0)
        return cls(count, mean, variance)


def histogram_edges(pooled: PooledMoments, bins: int = HISTOGRAM_BINS) -> np.ndarray:
    """A public grid per column (columns x bins+1 edges): the pooled mean +- HISTOGRAM_SPAN
    pooled standard deviations, so every party bins on the same edges."""
    std = np.sqrt(pooled.variance)
    half = HISTOGRAM_SPAN * np.where(std > 0, std, 1.0)
    steps = np.linspace(-1.0, 1.0, bins + 1)
    return pooled.mean[:, None] + half[:, None] * steps[None, :]


def histogram(X: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """One party's observed counts per bin, per column (below the grid, bins, above), flat."""
    X = np.asarray(X, dtype=float)
    out = []
    for j in range(X.shape[1]):
        observed = X[~np.isnan(X[:, j]), j]
        inner = edges[j]
        position = np.searchsorted(inner, observed, side="right")  # 0: below, len: above
        out.append(np.bincount(position, minlength=len(inner) + 1).astype(float))
    return np.concatenate(out)


def histogram_quantile(counts: np.ndarray, edges: np.ndarray, q: float) -> float:
    """The ``q`` quantile read from one column's pooled counts (linear within the bin); cells
    beyond the grid count at its ends."""
    counts = np.asarray(counts, dtype=float)
    total = counts.sum()
    if total <= 0:
        return math.nan
    target = q * total
    cumulative = np.cumsum(counts)
    k = int(np.searchsorted(cumulative, target, side="left"))
    if k == 0:
        return float(edges[0])
    if k >= len(counts) - 1:
        return float(edges[-1])
    before = cumulative[k - 1]
    share = (target - before) / counts[k] if counts[k] > 0 else 0.0
    low, high = edges[k - 1], edges[k]
    return float(low + share * (high - low))


def fit_pooled(
    total_moments: np.ndarray,
    names: Sequence[str],
    rows: int,
    spec: PreprocessingSpec,
    total_histogram: np.ndarray | None = None,
    edges: np.ndarray | None = None,
) -> FittedPreprocessing:
    """The fitted transform from summed :func:`moments` (and summed :func:`histogram` counts
    on ``edges`` when medians or quartiles are needed); ``rows`` is the pooled row count."""
    pooled = PooledMoments.from_sum(total_moments, len(names))
    summaries = []
    width = None if edges is None else edges.shape[1] + 1
    for j in range(len(names)):
        quartiles = None
        if total_histogram is not None and edges is not None and width is not None:
            counts = total_histogram[j * width : (j + 1) * width]
            quartiles = tuple(histogram_quantile(counts, edges[j], q) for q in (0.25, 0.5, 0.75))
        summaries.append(
            ColumnSummary(
                int(pooled.count[j]),
                float(pooled.mean[j]),
                float(np.sqrt(pooled.variance[j])),
                quartiles,  # type: ignore[arg-type]
            )
        )
    return fit(summaries, names, rows, spec)


def needs_quartiles(spec: PreprocessingSpec) -> bool:
    return spec.scaling == "robust" or spec.impute == "median"
