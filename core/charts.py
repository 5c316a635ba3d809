"""Training charts as hand-written SVG: loss per round, held-out ROC, held-out calibration.

Why SVG by hand: the charts travel inside a Prefect markdown artifact as ``data:image/svg+xml``
images (both Prefect UIs show those), so they must be small self-contained documents, and a
plotting library would be a heavy dependency for three line charts.

What a curve reveals: it is computed by the party holding the labels and only its operating
points leave it, at most ``max_points`` of them, each a count over a slice of at least
``rows / (max_points - 1)`` rows and at least ``min_rows`` (the scores' quantiles), so a chart
is an aggregate like the AUC it is titled with, not a list of rows.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from xml.sax.saxutils import escape

import numpy as np

__all__ = [
    "Calibration",
    "Frame",
    "RocCurve",
    "calibration_chart",
    "calibration_curve",
    "exact_auc",
    "loss_chart",
    "markdown_image",
    "nice_ticks",
    "roc_chart",
    "roc_curve",
]

#: Operating points a published curve keeps at most (ends included).
MAX_POINTS = 21
#: Rows a published operating point adds at least (a small hold-out gets fewer points).
MIN_ROWS_PER_POINT = 5
_FONT = 'font-family="DejaVu Sans, Helvetica, Arial, sans-serif"'
_LINE = "#1f6fb2"
_HELD_OUT = "#d1651b"
_GRID = "#d9d9d9"
_TEXT = "#222222"


# ---- curves (aggregates the labels party computes) ------------------------------------------
class _Points:
    """Plain JSON both ways, so task results and flow returns stay printable."""

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@dataclass(frozen=True)
class RocCurve(_Points):
    """A ROC curve's operating points, from (0, 0) to (1, 1), and the exact AUC of all rows."""

    fpr: tuple[float, ...]
    tpr: tuple[float, ...]
    auc: float
    rows: int


@dataclass(frozen=True)
class Calibration(_Points):
    """A regression's calibration: mean prediction and mean true value per prediction bin."""

    predicted: tuple[float, ...]
    observed: tuple[float, ...]
    mse: float
    rows: int


def exact_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the full ROC curve (the Mann-Whitney statistic, ties counted half)."""
    labels = np.asarray(labels, dtype=float)
    scores = np.asarray(scores, dtype=float)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)  # 1-based rank of each distinct score's last row
    ranks = (upper - (counts - 1) / 2.0)[inverse]  # average rank of tied scores
    positives = float(labels.sum())
    negatives = labels.size - positives
    return float(
        (ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives)
    )


def roc_curve(
    labels: Sequence[float] | np.ndarray,
    scores: Sequence[float] | np.ndarray,
    max_points: int = MAX_POINTS,
    min_rows: int = MIN_ROWS_PER_POINT,
) -> RocCurve | None:
    """The ROC curve of 0/1 ``labels`` ranked by ``scores`` (higher means positive), kept to
    at most ``max_points`` operating points at the scores' quantiles, each at least ``min_rows``
    rows past the one before; None unless both classes occur (no curve exists then)."""
    y = np.asarray(labels, dtype=float)
    s = np.asarray(scores, dtype=float)
    if y.shape != s.shape or y.ndim != 1:
        raise ValueError(f"roc_curve: {y.size} labels but {s.size} scores")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("roc_curve: labels must be 0 or 1")
    if not np.all(np.isfinite(s)):
        raise ValueError("roc_curve: scores must be finite")
    if len(set(y.tolist())) != 2:
        return None
    order = np.argsort(-s, kind="stable")
    y, s = y[order], s[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(s) != 0), y.size - 1]  # one point per threshold
    true_pos = np.cumsum(y)[last_of_tie]
    above = last_of_tie + 1.0  # rows scored at or above each threshold
    counts = np.r_[0.0, above]
    tpr = np.r_[0.0, true_pos / y.sum()]
    fpr = np.r_[0.0, (above - true_pos) / (y.size - y.sum())]
    kept = _spaced(counts, max(y.size / (max(max_points, 2) - 1), min_rows))
    return RocCurve(
        tuple(float(v) for v in fpr[kept]),
        tuple(float(v) for v in tpr[kept]),
        exact_auc(y, s),
        int(y.size),
    )


def _spaced(counts: np.ndarray, step: float) -> list[int]:
    """Indices of increasing ``counts`` from the first to the last, each at least ``step``
    above the one before (tied scores make jumps, so a point may be further on, never nearer)."""
    kept = [0]
    while (j := int(np.searchsorted(counts, counts[kept[-1]] + step, side="left"))) < counts.size:
        kept.append(j)
    if kept[-1] != counts.size - 1:  # end at (1, 1): the last kept point moves there
        if len(kept) > 1:
            kept.pop()
        kept.append(counts.size - 1)
    return kept


def calibration_curve(
    truth: Sequence[float] | np.ndarray,
    predictions: Sequence[float] | np.ndarray,
    bins: int = 10,
) -> Calibration | None:
    """Mean prediction against mean true value in ``bins`` bins of equal row count, ordered by
    prediction; None with fewer rows than bins (a bin would be a single person)."""
    t = np.asarray(truth, dtype=float)
    p = np.asarray(predictions, dtype=float)
    if t.shape != p.shape or t.ndim != 1:
        raise ValueError(f"calibration_curve: {t.size} true values but {p.size} predictions")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(p))):
        raise ValueError("calibration_curve: values must be finite")
    if t.size < bins or bins < 1:
        return None
    order = np.argsort(p, kind="stable")
    groups = np.array_split(order, bins)
    return Calibration(
        tuple(float(p[g].mean()) for g in groups),
        tuple(float(t[g].mean()) for g in groups),
        float(np.mean((p - t) ** 2)),
        int(t.size),
    )


# ---- drawing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """Maps data coordinates onto the plot area of an SVG canvas (y grows downwards there)."""

    x_min: float
    x_max: float
    y_min: float
    y_max: float
    width: int = 480
    height: int = 300
    left: int = 60
    right: int = 16
    top: int = 40
    bottom: int = 46

    def x(self, value: float) -> float:
        span = self.x_max - self.x_min or 1.0
        return self.left + (value - self.x_min) / span * (self.width - self.left - self.right)

    def y(self, value: float) -> float:
        span = self.y_max - self.y_min or 1.0
        plot = self.height - self.top - self.bottom
        return self.top + (self.y_max - value) / span * plot


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2 or 5 times a power of ten) covering
    [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("nice_ticks: bounds must be finite")
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    steps = math.ceil((high - first) / step - 1e-9)  # tolerate rounding of an exact multiple
    return [round(first + i * step, 12) for i in range(steps + 1)]


def _label(value: float) -> str:
    return f"{value:.4g}"


def _polyline(frame: Frame, xs: Sequence[float], ys: Sequence[float], **attributes: str) -> str:
    points = " ".join(f"{frame.x(x):.2f},{frame.y(y):.2f}" for x, y in zip(xs, ys, strict=True))
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attributes.items())
    return f'<polyline points="{points}" fill="none"{extra}/>'


def _canvas(frame: Frame, title: str, x_label: str, y_label: str, body: list[str]) -> str:
    """The SVG document: white background (readable in a dark UI too), grid, ticks, labels."""
    x_ticks = nice_ticks(frame.x_min, frame.x_max)
    y_ticks = nice_ticks(frame.y_min, frame.y_max)
    bottom, top = frame.height - frame.bottom, frame.top
    left, right = frame.left, frame.width - frame.right
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{frame.width}" height="{frame.height}" '
        f'viewBox="0 0 {frame.width} {frame.height}" {_FONT} font-size="11">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{frame.width}" height="{frame.height}" fill="#ffffff"/>',
    ]
    for t in x_ticks:
        if frame.x_min <= t <= frame.x_max:
            x = frame.x(t)
            parts.append(
                f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{bottom}" stroke="{_GRID}"/>'
            )
            parts.append(
                f'<text x="{x:.2f}" y="{bottom + 14}" text-anchor="middle" fill="{_TEXT}">'
                f"{_label(t)}</text>"
            )
    for t in y_ticks:
        if frame.y_min <= t <= frame.y_max:
            y = frame.y(t)
            parts.append(
                f'<line x1="{left}" y1="{y:.2f}" x2="{right}" y2="{y:.2f}" stroke="{_GRID}"/>'
            )
            parts.append(
                f'<text x="{left - 6}" y="{y + 4:.2f}" text-anchor="end" fill="{_TEXT}">'
                f"{_label(t)}</text>"
            )
    parts += [
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
        f'fill="none" stroke="#888888"/>',
        *body,
        f'<text x="{frame.width / 2:.1f}" y="22" text-anchor="middle" font-size="14" '
        f'font-weight="bold" fill="{_TEXT}">{escape(title)}</text>',
        f'<text x="{(left + right) / 2:.1f}" y="{frame.height - 8}" text-anchor="middle" '
        f'fill="{_TEXT}">{escape(x_label)}</text>',
        f'<text transform="translate(14 {(top + bottom) / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle" fill="{_TEXT}">{escape(y_label)}</text>',
        "</svg>",
    ]
    return "\n".join(parts)


def loss_chart(
    losses: Sequence[float],
    title: str = "Training loss per round",
    rounds: Sequence[int] | None = None,
    held_out: Mapping[int, float] | None = None,
) -> str:
    """Line chart of the loss per round, the rounds numbered from 0 as the rounds table and the
    log lines number them (``rounds``: each loss's round, default 0..n-1; a single round is
    drawn as a dot). ``held_out`` (round: loss on the held-out rows, measured at epoch ends)
    is drawn beside it, dashed, with a legend: the gap between the two is overfitting."""
    values = [float(v) for v in losses]
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError("loss_chart: needs at least one finite loss")
    rounds = list(range(len(values))) if rounds is None else [int(r) for r in rounds]
    if len(rounds) != len(values):
        raise ValueError(f"loss_chart: {len(values)} losses but {len(rounds)} rounds")
    checks = sorted((int(r), float(v)) for r, v in (held_out or {}).items() if math.isfinite(v))
    drawn = values + [v for _, v in checks]
    y_ticks = nice_ticks(min(drawn), max(drawn))
    last = max([rounds[-1], *(r for r, _ in checks)])
    frame = Frame(rounds[0], max(last, rounds[0] + 1), y_ticks[0], y_ticks[-1])
    body = [_series(frame, rounds, values, _LINE)]
    if checks:
        check_rounds, check_values = zip(*checks, strict=True)
        body.append(_series(frame, check_rounds, check_values, _HELD_OUT, dashed=True))
        lines = [("training rows", _LINE, False), ("held-out rows", _HELD_OUT, True)]
        body.append(_legend(frame, lines))
    return _canvas(frame, title, "round", "loss", body)


def _series(
    frame: Frame, xs: Sequence[int], ys: Sequence[float], colour: str, dashed: bool = False
) -> str:
    """One line of a chart, with a dot per point when there are few enough to see."""
    dash = {"stroke_dasharray": "6 4"} if dashed else {}
    parts = [_polyline(frame, xs, ys, stroke=colour, stroke_width="2", **dash)]
    if len(ys) <= 40:
        parts += [
            f'<circle cx="{frame.x(x):.2f}" cy="{frame.y(y):.2f}" r="2.5" fill="{colour}"/>'
            for x, y in zip(xs, ys, strict=True)
        ]
    return "\n".join(parts)


def _legend(frame: Frame, entries: Sequence[tuple[str, str, bool]]) -> str:
    """Top-right legend: a short stroke of each series' colour (dashed or not) and its name."""
    right, top = frame.width - frame.right, frame.top
    parts = []
    for i, (name, colour, dashed) in enumerate(entries):
        y = top + 14 + 16 * i
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        parts.append(
            f'<line x1="{right - 130}" y1="{y - 4}" x2="{right - 104}" y2="{y - 4}" '
            f'stroke="{colour}" stroke-width="2"{dash}/>'
        )
        parts.append(f'<text x="{right - 98}" y="{y}" fill="{_TEXT}">{escape(name)}</text>')
    return "\n".join(parts)


def roc_chart(curve: RocCurve, scope: str | None = None) -> str:
    """The ROC curve against the chance diagonal, titled with the exact AUC and which rows
    (``scope``, e.g. "47 held-out rows"; default: the row count)."""
    frame = Frame(0.0, 1.0, 0.0, 1.0, width=400, height=400)
    body = [
        _polyline(frame, [0, 1], [0, 1], stroke="#999999", stroke_dasharray="5 4"),
        _polyline(frame, curve.fpr, curve.tpr, stroke=_LINE, stroke_width="2.5"),
    ]
    title = f"ROC on {scope or f'{curve.rows} rows'}, AUC {curve.auc:.4f}"
    return _canvas(frame, title, "false positive rate", "true positive rate", body)


def calibration_chart(calibration: Calibration, scope: str | None = None) -> str:
    """Mean true value against mean prediction per bin, beside the line of perfect calibration,
    titled with the MSE of all rows and which rows (``scope``)."""
    values = [*calibration.predicted, *calibration.observed]
    ticks = nice_ticks(min(values), max(values))
    frame = Frame(ticks[0], ticks[-1], ticks[0], ticks[-1], width=400, height=400)
    low, high = ticks[0], ticks[-1]
    body = [
        _polyline(frame, [low, high], [low, high], stroke="#999999", stroke_dasharray="5 4"),
        _polyline(
            frame, calibration.predicted, calibration.observed, stroke=_LINE, stroke_width="2"
        ),
        *(
            f'<circle cx="{frame.x(p):.2f}" cy="{frame.y(o):.2f}" r="3" fill="{_LINE}"/>'
            for p, o in zip(calibration.predicted, calibration.observed, strict=True)
        ),
    ]
    title = f"Calibration on {scope or f'{calibration.rows} rows'}, MSE {calibration.mse:.4g}"
    return _canvas(frame, title, "mean prediction (bin)", "mean true value (bin)", body)


def markdown_image(svg: str, alt: str) -> str:
    """The chart as a markdown image with a base64 ``data:`` URI (no file, no server)."""
    encoded = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    text = alt.replace("[", "(").replace("]", ")")
    return f"![{text}](data:image/svg+xml;base64,{encoded})"
