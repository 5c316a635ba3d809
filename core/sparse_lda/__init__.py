"""Sparse linear discriminant analysis across parties (Tian, Jayaraman, Gu & Evans 2016).

Each party fits an L1-minimal LDA direction, debiases it with a sparse precision estimate,
and the directions and class means are averaged by secure aggregation with Gaussian noise
shares, then hard-thresholded. Pure maths: no orchestration imports.
"""

from core.sparse_lda.aggregation import (
    NO_THRESHOLD,
    SumVectors,
    ThresholdRule,
    hard_threshold,
    model_from_average,
    plain_sum,
    sum_contributions,
)
from core.sparse_lda.dantzig import scaled_radius, solve_l1_dantzig
from core.sparse_lda.errors import (
    ColumnMismatchError,
    ContributionError,
    DegenerateDataError,
    DimensionLimitError,
    InfeasibleProgramError,
    LabelValueError,
    MissingClassError,
    NonFiniteValueError,
    PrivacySettingsError,
    ShapeError,
    SparseLDAInputError,
)
from core.sparse_lda.local_fit import (
    LocalEstimate,
    LocalFitSettings,
    debias,
    degenerate_columns,
    fit_local,
)
from core.sparse_lda.methods import (
    check_columns_usable,
    fit_centralized,
    fit_debiased_aggregate,
    fit_moments_release,
    fit_naive_average,
    model_from_sum,
    party_contribution,
)
from core.sparse_lda.model import LinearDiscriminant
from core.sparse_lda.moments import ClassMoments, class_moments
from core.sparse_lda.moments_release import (
    model_from_statistics,
    statistics_norm_bound,
    statistics_vector,
)
from core.sparse_lda.party_data import MAX_FEATURES, PartyData, check_same_columns
from core.sparse_lda.precision import PrecisionMethod, clime_precision, nodewise_lasso_precision
from core.sparse_lda.privacy import (
    NoiseCalibration,
    PrivacySettings,
    PrivacyUnit,
    average_noise_std,
    calibrate,
    check_contribution,
    noise_left_after_collusion,
    noise_share_std,
    party_calibration,
    row_sensitivity,
    sum_noise_std,
    sum_sensitivity,
)

__all__ = [
    "MAX_FEATURES",
    "NO_THRESHOLD",
    "ClassMoments",
    "ColumnMismatchError",
    "ContributionError",
    "DegenerateDataError",
    "DimensionLimitError",
    "InfeasibleProgramError",
    "LabelValueError",
    "LinearDiscriminant",
    "LocalEstimate",
    "LocalFitSettings",
    "MissingClassError",
    "NoiseCalibration",
    "NonFiniteValueError",
    "PartyData",
    "PrecisionMethod",
    "PrivacySettings",
    "PrivacySettingsError",
    "PrivacyUnit",
    "ShapeError",
    "SparseLDAInputError",
    "SumVectors",
    "ThresholdRule",
    "average_noise_std",
    "calibrate",
    "check_columns_usable",
    "check_contribution",
    "check_same_columns",
    "class_moments",
    "clime_precision",
    "debias",
    "degenerate_columns",
    "fit_centralized",
    "fit_debiased_aggregate",
    "fit_local",
    "fit_moments_release",
    "fit_naive_average",
    "hard_threshold",
    "model_from_average",
    "model_from_statistics",
    "model_from_sum",
    "nodewise_lasso_precision",
    "noise_left_after_collusion",
    "noise_share_std",
    "party_calibration",
    "party_contribution",
    "plain_sum",
    "row_sensitivity",
    "scaled_radius",
    "solve_l1_dantzig",
    "statistics_norm_bound",
    "statistics_vector",
    "sum_contributions",
    "sum_noise_std",
    "sum_sensitivity",
]
