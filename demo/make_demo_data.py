"""Regenerate the bundled demo tables from scikit-learn's copy of the Wisconsin breast cancer data.

The 569 patients are split by columns: a *guest* (a clinic holding the diagnosis and the first
ten measurements) and a *host* (a lab holding the other twenty). Each side holds only some of
the patients (about 470 in common), with different id formats (integers at the guest, zero-free
strings at the host) to exercise id canonicalisation. Features are standardised per column,
as each party would do locally. Run from the repository root: ``python demo/make_demo_data.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import load_breast_cancer

OUT = Path(__file__).parent


def main() -> None:
    data = load_breast_cancer()
    features = (data.data - data.data.mean(axis=0)) / data.data.std(axis=0)
    names = [n.replace(" ", "_") for n in data.feature_names]
    rng = np.random.default_rng(20261121)
    ids = rng.choice(np.arange(10_000, 99_999), size=len(features), replace=False)
    order = rng.permutation(len(features))
    guest_rows, host_rows = order[:520], order[50:]
    guest = pd.DataFrame(features[guest_rows, :10], columns=names[:10])
    guest.insert(0, "diagnosis", data.target[guest_rows])  # 1 = benign, 0 = malignant
    guest.insert(0, "patient_id", ids[guest_rows])
    host = pd.DataFrame(features[host_rows, 10:], columns=names[10:])
    host.insert(0, "patient_id", [str(i) for i in ids[host_rows]])
    host = host.sample(frac=1.0, random_state=7)  # the lab's own row order
    guest.round(6).to_csv(OUT / "clinic_guest.csv", index=False)
    host.round(6).to_csv(OUT / "lab_host.csv", index=False)


if __name__ == "__main__":
    main()
