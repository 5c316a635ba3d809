"""What a party can check of its own entries of a job before anything moves.

A party holds its source files; the job file names their columns and sets rules that need
only sizes. Both are checked here, from the file's header and row count alone, so that a
missing column or a batch too small for a host's features is refused in seconds, naming the
party, the file and the column, instead of after PSI has run for minutes. ``privreg job
check`` runs these checks where the sources are, and every party's side runs them on its own
entries right after the terms are agreed (flows/pipeline_party.py).

The rules repeat nothing: the vertical batch rule is ``check_batches``' (tasks/vertical_lr.py)
in the form that needs no alignment: every mini-batch has at most ``batch_size`` rows, so a
``batch_size`` below a host's features + :data:`LABEL_LEAK_MARGIN` is refused whatever PSI
finds, and so is a host table with fewer rows than that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Rows beyond a host's feature count that every vertical mini-batch needs (see
#: ``tasks.vertical_lr.check_batches``: ``2**64`` label assignments stay consistent).
LABEL_LEAK_MARGIN = 64


@dataclass(frozen=True)
class SourceShape:
    """A source file as a check sees it: its header and how many data rows it holds."""

    columns: tuple[str, ...]
    rows: int


def entries(job: Any) -> dict[str, Any]:
    """The validated job's party entries by key (``guest``/``host``, or the hospitals' names)."""
    return dict(job.parties) if isinstance(job.parties, dict) else dict(vars(job.parties))


def entry_party(entry: Any) -> str:
    """The party an entry's table belongs to (its ``party``, else its database's name)."""
    return entry.table.party or Path(entry.table.database).stem


def feature_count(entry: Any, columns: tuple[str, ...], categorical: dict[str, list]) -> int:
    """The model's columns from this entry: its features (``feature_columns``, else every
    column but the id and the label), a categorical one counted once per category."""
    table = entry.table
    names = table.feature_columns or [
        c for c in columns if c not in (table.id_column, table.label_column)
    ]
    return sum(len(categorical[c]) if c in categorical else 1 for c in names)


def entry_problems(job: Any, key: str, shape: SourceShape, source: Path | str) -> list[str]:
    """Every problem of the entry ``key`` of the validated ``job`` (core/job_schema.py) that its
    source's ``shape`` shows, each a sentence naming the party, the file and the column."""
    entry = entries(job)[key]
    table = entry.table
    where = f"party {entry_party(entry)} ({key}), file {source}"
    problems = []
    named = [("id column", table.id_column), ("label column", table.label_column)]
    named += [("feature column", c) for c in table.feature_columns or []]
    for what, column in named:
        if column is not None and column not in shape.columns:
            problems.append(
                f"{where}: no {what} {column!r} (its columns: {', '.join(shape.columns)})"
            )
    psi = getattr(job, "psi", None)
    if psi is not None and shape.rows < psi.min_rows:
        problems.append(
            f"{where}: {shape.rows} rows, fewer than psi.min_rows = {psi.min_rows}; the "
            "intersection cannot reach it"
        )
    vertical = getattr(job, "vertical", None)
    if vertical is not None and key == "host" and not problems:
        features = feature_count(entry, shape.columns, _categorical(job, entry))
        needed = features + LABEL_LEAK_MARGIN
        if vertical.batch_size < needed or shape.rows < needed:
            problems.append(
                f"{where}: {features} features, so every vertical mini-batch needs at least "
                f"{needed} rows (features + {LABEL_LEAK_MARGIN}) or its gradient leaks labels; "
                f"vertical.batch_size is {vertical.batch_size} and the file has {shape.rows} "
                "rows: use a larger batch_size, fewer features or more rows"
            )
    return problems


def _categorical(job: Any, entry: Any) -> dict[str, list]:
    """The categorical columns the job and this entry declare (the entry's win)."""
    declared: dict[str, list] = {}
    for spec in (job.preprocessing, entry.preprocessing):
        if spec is not None and getattr(spec, "categorical", None):
            declared |= dict(spec.categorical)
    return declared
