"""Regenerate the horizontal demo: scikit-learn's breast cancer rows split across three hospitals.

Each hospital holds different patients with the same 30 measurements and the diagnosis
(1 = benign, 0 = malignant, as in scikit-learn), so the split is by rows. Features are
standardised with the fixed reference constants below rather than with statistics of the
pooled rows: every hospital can apply them on its own, and no pooled statistic has to be
computed before training. The split is a seeded permutation, so the files are reproducible.
Run from the repository root: ``python demo/make_horizontal_demo.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import load_breast_cancer

OUT = Path(__file__).parent / "horizontal"
SEED = 20261122
HOSPITAL_ROWS = {"hospital_a": 240, "hospital_b": 190, "hospital_c": 139}  # 569 in total

# (centre, scale) per measurement: the data set's means and standard deviations, rounded to
# six significant digits and written down once, so every hospital standardises identically.
REFERENCE_SCALING: dict[str, tuple[float, float]] = {
    "mean_radius": (14.1273, 3.52095),
    "mean_texture": (19.2896, 4.29725),
    "mean_perimeter": (91.969, 24.2776),
    "mean_area": (654.889, 351.605),
    "mean_smoothness": (0.0963603, 0.0140518),
    "mean_compactness": (0.104341, 0.0527663),
    "mean_concavity": (0.0887993, 0.0796497),
    "mean_concave_points": (0.0489191, 0.0387687),
    "mean_symmetry": (0.181162, 0.0273902),
    "mean_fractal_dimension": (0.0627976, 0.00705416),
    "radius_error": (0.405172, 0.277069),
    "texture_error": (1.21685, 0.551163),
    "perimeter_error": (2.86606, 2.02008),
    "area_error": (40.3371, 45.451),
    "smoothness_error": (0.00704098, 0.00299988),
    "compactness_error": (0.0254781, 0.0178924),
    "concavity_error": (0.0318937, 0.0301595),
    "concave_points_error": (0.0117961, 0.00616486),
    "symmetry_error": (0.0205423, 0.0082591),
    "fractal_dimension_error": (0.0037949, 0.00264374),
    "worst_radius": (16.2692, 4.82899),
    "worst_texture": (25.6772, 6.14085),
    "worst_perimeter": (107.261, 33.573),
    "worst_area": (880.583, 568.856),
    "worst_smoothness": (0.132369, 0.0228124),
    "worst_compactness": (0.254265, 0.157198),
    "worst_concavity": (0.272188, 0.208441),
    "worst_concave_points": (0.114606, 0.0656746),
    "worst_symmetry": (0.290076, 0.0618131),
    "worst_fractal_dimension": (0.0839458, 0.0180454),
}


def standardised_table() -> pd.DataFrame:
    """All 569 patients: id, diagnosis and the 30 standardised measurements."""
    data = load_breast_cancer()
    names = [n.replace(" ", "_") for n in data.feature_names]
    if names != list(REFERENCE_SCALING):
        raise RuntimeError("scikit-learn's feature names changed; update REFERENCE_SCALING")
    centre = np.array([REFERENCE_SCALING[n][0] for n in names])
    scale = np.array([REFERENCE_SCALING[n][1] for n in names])
    table = pd.DataFrame((data.data - centre) / scale, columns=names).round(6)
    rng = np.random.default_rng(SEED)
    table.insert(0, "diagnosis", data.target)
    table.insert(0, "patient_id", rng.choice(np.arange(100_000, 1_000_000), len(table), False))
    return table.iloc[rng.permutation(len(table))].reset_index(drop=True)


def main() -> None:
    table = standardised_table()
    OUT.mkdir(exist_ok=True)
    start = 0
    for hospital, rows in HOSPITAL_ROWS.items():
        table.iloc[start : start + rows].to_csv(OUT / f"{hospital}.csv", index=False)
        start += rows
    if start != len(table):
        raise RuntimeError(f"the split covers {start} of {len(table)} rows")


if __name__ == "__main__":
    main()
