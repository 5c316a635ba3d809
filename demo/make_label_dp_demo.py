"""Regenerate the label-DP demo tables from scikit-learn's copy of the diabetes data set.

The 442 patients' disease progression one year after baseline (an integer score) is the label.
The table is split by columns: a *registry* holds the patient id and the progression score
(the protected labels), a *clinic* holds the same patients' ten baseline measurements (age,
sex, BMI, blood pressure and six blood serum values, in their original units). Both hold the
same ids; the clinic keeps its rows in its own order, so the flow has to align them first.
Run from the repository root: ``python demo/make_label_dp_demo.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import load_diabetes

OUT = Path(__file__).parent / "label_dp"


def main() -> None:
    data = load_diabetes(scaled=False)
    ids = [f"D{i:04d}" for i in range(1, len(data.target) + 1)]
    registry = pd.DataFrame({"patient_id": ids, "progression": data.target.astype(int)})
    clinic = pd.DataFrame(data.data, columns=list(data.feature_names))
    clinic.insert(0, "patient_id", ids)
    clinic = clinic.iloc[np.random.default_rng(442).permutation(len(clinic))]
    OUT.mkdir(exist_ok=True)
    registry.to_csv(OUT / "registry_labels.csv", index=False)
    clinic.round(4).to_csv(OUT / "clinic_features.csv", index=False)


if __name__ == "__main__":
    main()
