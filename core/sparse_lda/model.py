"""The LDA decision rule shared by every fitting method."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.sparse_lda.errors import ShapeError
from core.sparse_lda.party_data import NEGATIVE_LABEL, POSITIVE_LABEL


@dataclass(frozen=True)
class LinearDiscriminant:
    """Fisher's rule with equal class priors.

    ``direction`` estimates ``beta = Sigma^{-1} (mu1 - mu2)``, so the score
    ``(x - (mu1 + mu2)/2)^T beta`` is positive on the mu1 side: a positive score predicts label
    1 (the paper's class 1), a non-positive one label 0 (class 2).
    """

    direction: np.ndarray
    mean_positive: np.ndarray
    mean_negative: np.ndarray

    def decision_scores(self, features: np.ndarray) -> np.ndarray:
        """Signed scores; positive means label 1 is more likely."""
        rows = np.asarray(features, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != self.direction.shape[0]:
            raise ShapeError(
                f"expected features of shape (rows, {self.direction.shape[0]}), got {rows.shape}"
            )
        midpoint = (self.mean_positive + self.mean_negative) / 2.0
        return (rows - midpoint) @ self.direction

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted 0/1 labels."""
        positive = self.decision_scores(features) > 0
        return np.where(positive, POSITIVE_LABEL, NEGATIVE_LABEL).astype(np.int8)

    def error_rate(self, features: np.ndarray, labels: np.ndarray) -> float:
        """Fraction of misclassified rows."""
        return float(np.mean(self.predict(features) != np.asarray(labels)))

    @property
    def support_size(self) -> int:
        return int(np.count_nonzero(self.direction))
