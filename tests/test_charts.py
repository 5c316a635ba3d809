"""The training charts: well-formed SVG, data drawn where it belongs, exact AUC, aggregates only."""

from __future__ import annotations

import base64
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from helpers import chart_images
from sklearn.metrics import roc_auc_score

from core.charts import (
    MAX_POINTS,
    Calibration,
    Frame,
    RocCurve,
    calibration_chart,
    calibration_curve,
    loss_chart,
    markdown_image,
    nice_ticks,
    roc_chart,
    roc_curve,
)
from tasks.charts import publish_training_charts

SVG = "{http://www.w3.org/2000/svg}"


def _polylines(svg: str) -> list[list[tuple[float, float]]]:
    root = ET.fromstring(svg)  # raises unless the document is well-formed XML
    assert root.tag == f"{SVG}svg"
    return [
        [tuple(float(v) for v in point.split(",")) for point in line.get("points").split()]
        for line in root.iter(f"{SVG}polyline")
    ]


def _title(svg: str) -> str:
    return ET.fromstring(svg).find(f"{SVG}title").text


@pytest.fixture(scope="module")
def scored() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 2, 500).astype(float)
    scores = np.round(labels + rng.normal(size=500), 1)  # rounded: many tied scores
    return labels, scores


def test_the_loss_chart_puts_every_round_at_its_coordinates() -> None:
    losses = [0.69, 0.52, 0.47, 0.44, 0.431]
    svg = loss_chart(losses)
    [line] = _polylines(svg)
    ticks = nice_ticks(min(losses), max(losses))
    frame = Frame(0, len(losses) - 1, ticks[0], ticks[-1])
    expected = [(frame.x(r), frame.y(v)) for r, v in enumerate(losses)]
    np.testing.assert_allclose(line, expected, atol=0.01)
    assert line[0][0] == pytest.approx(frame.left) and line[-1][0] == pytest.approx(464)
    assert all(np.diff([y for _, y in line]) > 0)  # the loss falls: SVG y grows downwards
    assert svg.count("<circle") == len(losses)
    with pytest.raises(ValueError, match="finite"):
        loss_chart([0.7, float("nan")])


def test_the_held_out_loss_is_drawn_beside_the_training_loss() -> None:
    """Measured at epoch ends only: its own dashed line on the same axes, named in a legend."""
    svg = loss_chart([0.69, 0.6, 0.5, 0.45], held_out={1: 0.62, 3: 0.75})
    training, held_out = _polylines(svg)
    ticks = nice_ticks(0.45, 0.75)  # the axis covers both series
    frame = Frame(0, 3, ticks[0], ticks[-1])
    expected = [(frame.x(1), frame.y(0.62)), (frame.x(3), frame.y(0.75))]
    np.testing.assert_allclose(held_out, expected, atol=0.01)
    assert len(training) == 4 and svg.count("<circle") == 6
    assert "training rows" in svg and "held-out rows" in svg
    assert "held-out" not in loss_chart([0.69, 0.6])  # no legend without a second line


def _x_labels(svg: str) -> list[str]:
    """The round axis's tick labels (the texts under the plot, centred on a tick)."""
    root = ET.fromstring(svg)
    bottom = Frame(0, 1, 0, 1).height - Frame(0, 1, 0, 1).bottom + 14
    texts = root.iter(f"{SVG}text")
    return [t.text for t in texts if t.get("y") == str(bottom) and t.get("text-anchor") == "middle"]


def test_rounds_are_numbered_from_0_as_in_the_rounds_table_and_the_log() -> None:
    """The rounds table and the log lines say round 0 for the first round: so does the chart,
    and a round without a loss keeps the next rounds' numbers."""
    assert _x_labels(loss_chart([0.69, 0.6, 0.5, 0.45, 0.44]))[:2] == ["0", "1"]
    assert _x_labels(loss_chart([0.69, 0.5, 0.45], rounds=[0, 2, 3]))[0] == "0"
    [line] = _polylines(loss_chart([0.69, 0.5, 0.45], rounds=[0, 2, 3]))
    frame = Frame(0, 3, 0.4, 0.7)
    assert [round(x, 1) for x, _ in line] == [round(frame.x(r), 1) for r in (0, 2, 3)]
    single = loss_chart([0.69])  # one round: a dot at round 0
    assert _x_labels(single)[0] == "0" and single.count("<circle") == 1
    with pytest.raises(ValueError, match="2 losses but 1 rounds"):
        loss_chart([0.7, 0.6], rounds=[0])


def test_the_frame_maps_the_data_range_onto_the_plot_area() -> None:
    frame = Frame(0.0, 10.0, -1.0, 1.0, width=200, height=100, left=20, right=10, top=5, bottom=15)
    assert (frame.x(0.0), frame.x(10.0), frame.x(5.0)) == (20, 190, 105)
    assert (frame.y(1.0), frame.y(-1.0), frame.y(0.0)) == (5, 85, 45)


def test_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    ticks = nice_ticks(0.431, 0.69)
    assert ticks[0] <= 0.431 and ticks[-1] >= 0.69 and len(ticks) <= 7


def test_the_roc_runs_from_0_0_to_1_1_and_its_title_has_sklearn_s_auc(scored) -> None:
    labels, scores = scored
    curve = roc_curve(labels, scores)
    assert (curve.fpr[0], curve.tpr[0]) == (0.0, 0.0)
    assert (curve.fpr[-1], curve.tpr[-1]) == (1.0, 1.0)
    assert np.all(np.diff(curve.fpr) >= 0) and np.all(np.diff(curve.tpr) >= 0)
    assert curve.auc == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    svg = roc_chart(curve, "500 held-out rows")
    assert _title(svg) == f"ROC on 500 held-out rows, AUC {roc_auc_score(labels, scores):.4f}"
    diagonal, drawn = _polylines(svg)
    frame = Frame(0.0, 1.0, 0.0, 1.0, width=400, height=400)
    assert drawn[0] == pytest.approx((frame.x(0), frame.y(0)), abs=0.01)
    assert drawn[-1] == pytest.approx((frame.x(1), frame.y(1)), abs=0.01)
    np.testing.assert_allclose(diagonal, [drawn[0], drawn[-1]], atol=0.01)


@pytest.mark.parametrize("decimals", [None, 1])  # distinct scores; many tied scores
def test_the_published_roc_is_a_few_operating_points_not_the_rows(decimals: int | None) -> None:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 1000)
    scores = rng.normal(size=1000) + labels
    curve = roc_curve(labels, scores if decimals is None else np.round(scores, decimals))
    assert len(curve.fpr) <= MAX_POINTS
    # each point is a threshold with at least 1/20 of the rows more above it than the last
    above = np.asarray(curve.fpr) * (1000 - labels.sum()) + np.asarray(curve.tpr) * labels.sum()
    assert np.all(np.diff(np.round(above)) >= 1000 / (MAX_POINTS - 1))
    # a perfect ranking passes through (0, 1); its curve survives the trip through JSON
    perfect = roc_curve([0, 0, 1, 1, 0, 1], [0.1, 0.2, 0.8, 0.9, 0.3, 0.7], min_rows=1)
    assert perfect.auc == 1.0 and (0.0, 1.0) in set(zip(perfect.fpr, perfect.tpr, strict=True))
    assert RocCurve.from_dict(perfect.to_dict()) == perfect
    few = roc_curve(labels[:20], scores[:20])  # a small hold-out: points of 5 rows at least
    assert len(few.fpr) <= 5 and few.auc == pytest.approx(roc_auc_score(labels[:20], scores[:20]))


def test_bad_curve_inputs_are_refused_and_one_class_has_no_curve() -> None:
    assert roc_curve([1, 1, 1], [0.2, 0.5, 0.9]) is None
    with pytest.raises(ValueError, match="0 or 1"):
        roc_curve([0, 2, 1], [0.2, 0.5, 0.9])
    with pytest.raises(ValueError, match="3 labels but 2 scores"):
        roc_curve([0, 1, 1], [0.2, 0.5])
    with pytest.raises(ValueError, match="finite"):
        roc_curve([0, 1, 1], [0.2, np.inf, 0.9])
    assert calibration_curve(np.arange(5.0), np.arange(5.0)) is None  # a bin would be one row


def test_calibration_bins_average_equal_row_counts() -> None:
    rng = np.random.default_rng(3)
    truth = rng.normal(10, 3, 200)
    predictions = truth + rng.normal(0, 1, 200)
    curve = calibration_curve(truth, predictions)
    order = np.argsort(predictions)
    assert curve.predicted == pytest.approx(
        [predictions[order[i * 20 : i * 20 + 20]].mean() for i in range(10)]
    )
    assert curve.observed == pytest.approx(
        [truth[order[i * 20 : i * 20 + 20]].mean() for i in range(10)]
    )
    assert curve.mse == pytest.approx(np.mean((predictions - truth) ** 2))
    svg = calibration_chart(curve, "200 held-out rows")
    _, drawn = _polylines(svg)
    assert len(drawn) == 10 and svg.count("<circle") == 10
    assert Calibration.from_dict(curve.to_dict()) == curve


def test_a_chart_becomes_a_markdown_data_image_and_back(scored) -> None:
    svg = roc_chart(roc_curve(*scored), "a <b> & [c]")  # escaped in the SVG, bracket-safe alt
    text = markdown_image(svg, "ROC, [held-out]")
    assert text.startswith("![ROC, (held-out)](data:image/svg+xml;base64,")
    assert chart_images(text) == [svg]
    assert base64.b64decode(text.split(",", 2)[-1].rstrip(")")).decode() == svg
    assert "a &lt;b&gt; &amp; [c]" in svg


def test_nothing_to_draw_publishes_nothing() -> None:
    assert publish_training_charts("walr", "job", [], {"47 held-out rows": None}) is None
