"""Training charts in the Prefect UI: one markdown artifact per run, ``<job>-<flow>-charts``.

More: docs/reporting.md (what a run publishes, and why).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from prefect import task

from core.charts import (
    Calibration,
    RocCurve,
    calibration_chart,
    calibration_curve,
    loss_chart,
    markdown_image,
    roc_chart,
    roc_curve,
)
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks.policy import PARTY_STEP
from tasks.reporting import artifact_key, publish_markdown

__all__ = ["held_out_calibration", "held_out_roc", "own_rows_roc", "publish_training_charts"]


def held_out_roc(labels: np.ndarray, scores: np.ndarray) -> dict[str, Any] | None:
    """The labels party's ROC operating points of its evaluated rows (None with one class)."""
    curve = roc_curve(labels, scores)
    return None if curve is None else curve.to_dict()


def held_out_calibration(truth: np.ndarray, predictions: np.ndarray) -> dict[str, Any] | None:
    """The labels party's calibration bins of its evaluated rows (None with under 10 rows)."""
    calibration = calibration_curve(truth, predictions)
    return None if calibration is None else calibration.to_dict()


@task(name="held-out-roc", task_run_name="{ref.party}: ROC on own labels", **PARTY_STEP)
def own_rows_roc(
    ref: TableRef, probabilities: np.ndarray, train_rows: np.ndarray, holdout_rows: np.ndarray
) -> dict[str, dict[str, Any] | None]:
    """The labels party's ROC of its held-out rows (every row, in-sample, when none are held
    out) scored with ``probabilities`` (one per row of its table), as ``{which rows: points}``."""
    labels = PartyStore.of(ref).read_table(ref, allow_missing=True)[ref.label_column]
    rows = holdout_rows if len(holdout_rows) else train_rows
    scope = (
        f"{len(rows)} held-out rows" if len(holdout_rows) else f"all {len(rows)} rows (in-sample)"
    )
    return {scope: held_out_roc(labels.to_numpy(dtype=float)[rows], probabilities[rows])}


def _chart(scope: str, points: dict[str, Any]) -> str:
    if "fpr" in points:
        return markdown_image(roc_chart(RocCurve.from_dict(points), scope), f"ROC, {scope}")
    calibration = Calibration.from_dict(points)
    return markdown_image(calibration_chart(calibration, scope), f"calibration, {scope}")


def publish_training_charts(
    flow: str,
    job_id: str,
    losses: Sequence[float | None] = (),
    curves: Mapping[str, dict[str, Any] | None] | None = None,
    held_out_losses: Mapping[int, float] | None = None,
) -> str | None:
    """Publish the loss per round (and ``held_out_losses``, round: loss on the held-out rows,
    beside it) and each held-out curve (``{which rows: points}``, from :func:`held_out_roc` or
    :func:`held_out_calibration`) as one markdown artifact; returns its key, or None when
    there is nothing to draw. Called from a flow's run."""
    known = [(r, float(v)) for r, v in enumerate(losses) if v is not None]  # round r: losses[r]
    drawn = {scope: points for scope, points in (curves or {}).items() if points}
    if not known and not drawn:
        return None
    parts = [f"### {flow}: training charts of job `{job_id}`"]
    if known:
        rounds, values = zip(*known, strict=True)
        chart = loss_chart(values, rounds=rounds, held_out=held_out_losses)
        what = "training and held-out loss" if held_out_losses else "training loss"
        parts.append(markdown_image(chart, f"{what} per round (rounds from 0)"))
    parts += [_chart(scope, points) for scope, points in drawn.items()]
    key = artifact_key(flow, job_id, "charts")
    publish_markdown(key, "\n\n".join(parts), f"{flow} charts of job {job_id}")
    return key
