"""Validation of a party's table before it is stored.

Every error names the table, the column and the first offending row (1-based data row, and
its id where there is one), so a data owner can fix the source file directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from core.ids import IdError, canonical_id
from core.preprocessing import MissingColumn, missing_columns, missing_message
from storage.descriptor import TableRef


class DataValidationError(ValueError):
    """A table failed validation; the message says where."""

    def __init__(
        self, table: str, column: str | None, row: int | None, problem: str, row_id: object = None
    ) -> None:
        self.table, self.column, self.row, self.problem = table, column, row, problem
        where = f"table {table!r}"
        if column is not None:
            where += f", column {column!r}"
        if row is not None:
            where += f", row {row}"
            if row_id is not None:  # a plain number, not np.int64(3)
                where += f" (id {getattr(row_id, 'item', lambda: row_id)()!r})"
        super().__init__(f"{where}: {problem}")


class MissingValuesError(DataValidationError):
    """Feature cells are missing and nothing imputes them; names every column at once."""

    def __init__(self, table: str, gaps: Sequence[MissingColumn], rows: int) -> None:
        self.gaps = list(gaps)
        ValueError.__init__(self, missing_message(f"table {table!r}", gaps, rows))
        self.table, self.column, self.row = table, gaps[0].column, gaps[0].first_row
        self.problem = "missing values"


def resolve_feature_columns(ref: TableRef, columns: Sequence[str]) -> list[str]:
    if ref.feature_columns is not None:
        return list(ref.feature_columns)
    excluded = {ref.id_column, ref.label_column}
    return [c for c in columns if c not in excluded]


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _validate_ids(frame: pd.DataFrame, ref: TableRef) -> None:
    ids = frame[ref.id_column]
    missing = ids.isna().to_numpy()
    if missing.any():
        raise DataValidationError(ref.table, ref.id_column, _first(missing) + 1, "id is null")
    seen: dict[bytes, int] = {}
    for position, value in enumerate(ids.tolist()):
        try:
            key = canonical_id(value)
        except IdError as error:
            raise DataValidationError(ref.table, ref.id_column, position + 1, str(error)) from None
        if key in seen:
            raise DataValidationError(
                ref.table,
                ref.id_column,
                position + 1,
                f"duplicate id (same canonical id as row {seen[key] + 1})",
                value,
            )
        seen[key] = position


def _numeric(
    frame: pd.DataFrame, ref: TableRef, column: str, what: str, missing_ok: bool = False
) -> np.ndarray:
    raw = frame[column]
    values = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    unparsable = np.isnan(values) & raw.notna().to_numpy()
    if unparsable.any():
        row = _first(unparsable)
        raise DataValidationError(
            ref.table,
            column,
            row + 1,
            f"{what} {raw.iloc[row]!r} is not numeric",
            frame[ref.id_column].iloc[row],
        )
    bad = ~np.isfinite(values) & ~(missing_ok & np.isnan(values))
    if bad.any():
        row = _first(bad)
        kind = "missing (null/NaN)" if np.isnan(values[row]) else "infinite"
        raise DataValidationError(
            ref.table, column, row + 1, f"{what} is {kind}", frame[ref.id_column].iloc[row]
        )
    return values


def _check_span(frame: pd.DataFrame, ref: TableRef, column: str, values: np.ndarray) -> None:
    """Refuses a feature whose values lie further apart than the largest float (1.8e308).

    Why: scaling subtracts a centre between the column's smallest and largest value from every
    value. Its statistics are finite for any finite column (``core.preprocessing``), but such
    a difference is not, and an infinite cell would silently decide the model. Names the row
    that first makes the span overflow, and the row at the other end.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        span = np.fmax.accumulate(values) - np.fmin.accumulate(values)  # NaN cells skipped
    over = np.isinf(span)
    if not over.any():
        return
    row = _first(over)
    before = values[:row]
    other = int(np.nanargmin(before) if values[row] > 0 else np.nanargmax(before))
    raise DataValidationError(
        ref.table,
        column,
        row + 1,
        f"feature {values[row]:g} is further from row {other + 1}'s {values[other]:g} than the "
        f"largest float ({np.finfo(float).max:.4g}), so the column cannot be centred; divide "
        "the column by a power of ten in the source",
        frame[ref.id_column].iloc[row],
    )


def validate_frame(
    frame: pd.DataFrame, ref: TableRef, allow_missing: bool = False, check_ids: bool = True
) -> pd.DataFrame:
    """Check ``frame`` against ``ref`` and return it in canonical column order and dtypes.

    Returns a new frame: id column, then label (as float), then features (as float64).
    Missing feature cells are refused, every affected column named at once with its count,
    unless ``allow_missing`` (a table whose job imputes them: see ``core.preprocessing``).
    """
    required = [ref.id_column]
    if ref.label_column is not None:
        required.append(ref.label_column)
    if ref.feature_columns is not None:
        required.extend(ref.feature_columns)
    for column in required:
        if column not in frame.columns:
            raise DataValidationError(
                ref.table,
                column,
                None,
                f"column is missing (columns present: {', '.join(map(str, frame.columns))})",
            )
    if len(frame) == 0:
        raise DataValidationError(ref.table, None, None, "table is empty")
    frame = frame.reset_index(drop=True)
    if check_ids:  # off only for a caller that has just checked every id itself (PSI)
        _validate_ids(frame, ref)
    features = resolve_feature_columns(ref, [str(c) for c in frame.columns])
    columns: dict[str, object] = {ref.id_column: frame[ref.id_column]}
    if ref.label_column is not None:
        labels = _numeric(frame, ref, ref.label_column, "label")
        if ref.label_domain is not None:
            allowed = np.array(ref.label_domain, dtype=float)
            outside = ~np.isin(labels, allowed)
            if outside.any():
                row = _first(outside)
                domain = ", ".join(f"{v:g}" for v in allowed)
                raise DataValidationError(
                    ref.table,
                    ref.label_column,
                    row + 1,
                    f"label {labels[row]:g} is outside the declared domain {{{domain}}}",
                    frame[ref.id_column].iloc[row],
                )
        columns[ref.label_column] = labels
    for column in features:
        columns[column] = _numeric(frame, ref, column, "feature", missing_ok=True)
        _check_span(frame, ref, column, columns[column])
    if features and not allow_missing:
        X = np.column_stack([columns[c] for c in features])
        gaps = missing_columns(X, features)
        if gaps:
            raise MissingValuesError(ref.table, gaps, len(frame))
    return pd.DataFrame(columns)  # built at once: column-by-column inserts fragment the frame
