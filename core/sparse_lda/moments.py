"""Class means and the pooled within-class covariance: the only statistics LDA needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.sparse_lda.party_data import NEGATIVE_LABEL, POSITIVE_LABEL


@dataclass(frozen=True)
class ClassMoments:
    """Sample moments of one dataset.

    ``centered_rows`` keeps each row minus its own class mean, because the nodewise-lasso
    precision estimate regresses on rows rather than on the covariance matrix.
    """

    mean_positive: np.ndarray
    mean_negative: np.ndarray
    covariance: np.ndarray
    centered_rows: np.ndarray

    @property
    def mean_difference(self) -> np.ndarray:
        """``mu_d = mu1 - mu2`` in the paper's notation (label 1 minus label 0)."""
        return self.mean_positive - self.mean_negative

    @property
    def n_rows(self) -> int:
        return int(self.centered_rows.shape[0])


def class_moments(features: np.ndarray, labels: np.ndarray) -> ClassMoments:
    """Class means and the pooled covariance ``(1/n) sum_i (x_i - mu_{y_i})(x_i - mu_{y_i})^T``.

    Dividing by n rather than n - 2 follows the usual LDA plug-in estimator; the difference is
    immaterial next to the L1 constraint radius.
    """
    mean_positive = features[labels == POSITIVE_LABEL].mean(axis=0)
    mean_negative = features[labels == NEGATIVE_LABEL].mean(axis=0)
    centered = centre_within_classes(features, labels)
    covariance = centered.T @ centered / features.shape[0]
    return ClassMoments(mean_positive, mean_negative, covariance, centered)


def centre_within_classes(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Each row minus its own class's mean; a class with no rows needs no mean."""
    centered = np.array(features, dtype=np.float64, copy=True)
    for label in (POSITIVE_LABEL, NEGATIVE_LABEL):
        rows = labels == label
        if rows.any():
            centered[rows] -= features[rows].mean(axis=0)
    return centered


def column_variances(centered: np.ndarray) -> np.ndarray:
    """Each column's mean square: the covariance's diagonal without forming the d x d matrix."""
    return np.einsum("ij,ij->j", centered, centered) / centered.shape[0]
