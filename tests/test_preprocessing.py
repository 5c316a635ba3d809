"""Preprocessing maths: spec, disguised missing values, categories, local and pooled fits."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from core import preprocessing as pp


def test_spec_from_job_dict_and_party_merge() -> None:
    spec = pp.PreprocessingSpec.from_dict(
        {"impute": "median", "missing_values": {"*": ["?"]}, "categorical": {"cp": [1, 2]}}
    )
    merged = spec.with_party({"missing_values": {"chol": [0]}})
    assert merged.missing_for("chol") == ("?", 0)
    assert merged.missing_for("age") == ("?",)
    assert pp.PreprocessingSpec.from_dict(merged.to_dict()) == merged
    assert pp.PreprocessingSpec.from_dict(None).scaling == "standard"
    with pytest.raises(pp.PreprocessingError, match="scaling 'minmax'"):
        pp.PreprocessingSpec.from_dict({"scaling": "minmax"})
    with pytest.raises(pp.PreprocessingError, match="unknown preprocessing keys"):
        pp.PreprocessingSpec.from_dict({"imputer": "mean"})
    with pytest.raises(pp.PreprocessingError, match="only set missing_values"):
        spec.with_party({"scaling": "none"})


def test_disguised_missing_values_and_categories() -> None:
    frame = pd.DataFrame(
        {"id": [1, 2, 3, 4], "chol": [200, 0, 180, "?"], "cp": [1, 2, "?", 1], "y": [0, 1, 0, 1]}
    )
    spec = pp.PreprocessingSpec.from_dict(
        {"missing_values": {"chol": [0], "*": ["?"]}, "categorical": {"cp": [1, 2]}}
    )
    out = pp.prepare_raw(frame, spec, ["id", "y"], "patients")
    assert list(out.columns) == ["id", "chol", "cp_1", "cp_2", "y"]
    chol = pd.to_numeric(out["chol"]).to_numpy(dtype=float)
    np.testing.assert_array_equal(np.isnan(chol), [False, True, False, True])
    np.testing.assert_array_equal(out["cp_1"].to_numpy(dtype=float)[[0, 1, 3]], [1, 0, 1])
    assert np.isnan(out["cp_2"].to_numpy(dtype=float)[2])
    with pytest.raises(pp.PreprocessingError, match=r"column 'cp', row 2: value 7 .*categor"):
        pp.prepare_raw(frame.assign(cp=[1, 7, 2, 1]), spec, ["id", "y"], "patients")


def test_missing_cells_are_reported_at_once_and_imputed_locally() -> None:
    X = np.array([[1.0, np.nan, 3.0], [np.nan, np.nan, 5.0], [4.0, 2.0, 7.0], [5.0, 6.0, 9.0]])
    names = ["a", "b", "c"]
    refused = pp.fit_local(X, names, pp.PreprocessingSpec())
    with pytest.raises(pp.PreprocessingError) as error:
        refused.transform(X, "party p, table t")
    text = str(error.value)
    assert "column 'a': 1 of 4 rows (first row 2)" in text
    assert "column 'b': 2 of 4 rows (first row 1)" in text
    assert "preprocessing.impute" in text
    spec = pp.PreprocessingSpec(impute="median", missing_indicator=True)
    fitted = pp.fit_local(X, names, spec)
    assert fitted.output_names == ["a", "b", "c", "a_missing", "b_missing"]
    out = fitted.transform(X)
    observed = np.array([1.0, 4.0, 5.0])
    assert out[1, 0] == pytest.approx((4.0 - observed.mean()) / observed.std())
    np.testing.assert_array_equal(out[:, 3:], [[0, 1], [1, 1], [0, 0], [0, 0]])
    again = pp.FittedPreprocessing.from_dict(fitted.to_dict())
    np.testing.assert_array_equal(again.transform(X), out)


def test_pooled_statistics_equal_the_pooled_rows_in_the_clear() -> None:
    rng = np.random.default_rng(5)
    parts = [rng.normal(50.0, 12.0, size=(n, 2)) * [1.0, 1e3] for n in (40, 90, 61)]
    parts[1][::7, 0] = np.nan
    pooled = np.vstack(parts)
    names = ["x", "y"]
    spec = pp.PreprocessingSpec(scaling="robust", impute="median")
    total = sum(pp.moments(p) for p in parts)
    moments = pp.PooledMoments.from_sum(total, 2)
    edges = pp.histogram_edges(moments)
    counts = sum(pp.histogram(p, edges) for p in parts)
    fitted = pp.fit_pooled(total, names, len(pooled), spec, counts, edges)
    width = edges.shape[1] + 1
    for j, column in enumerate(fitted.columns):
        observed = np.sort(pooled[~np.isnan(pooled[:, j]), j])
        bin_width = edges[j, 1] - edges[j, 0]
        assert moments.mean[j] == pytest.approx(observed.mean(), rel=1e-12)
        assert np.sqrt(moments.variance[j]) == pytest.approx(observed.std(), rel=1e-9)
        column_counts = counts[j * width : (j + 1) * width]
        for q in (0.25, 0.5, 0.75):  # between the order statistics around q, to a bin
            at = q * len(observed)
            low = observed[int(np.floor(at)) - 1] - bin_width
            high = observed[min(int(np.ceil(at)), len(observed) - 1)] + bin_width
            assert low <= pp.histogram_quantile(column_counts, edges[j], q) <= high
        assert column.fill == pp.histogram_quantile(column_counts, edges[j], 0.5)
        assert column.fill == pytest.approx(np.median(observed), rel=0.02)
    assert fitted.columns[0].missing == int(np.isnan(pooled[:, 0]).sum())
    mean_spec = pp.PreprocessingSpec(impute="mean")
    mean_fit = pp.fit_pooled(total, names, len(pooled), mean_spec)
    assert mean_fit.columns[0].fill == pytest.approx(np.nanmean(pooled[:, 0]), rel=1e-12)
