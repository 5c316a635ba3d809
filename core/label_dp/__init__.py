"""Label-DP regression maths: RR-on-Bins, its private prior, and baseline mechanisms.

Every mechanism follows ``mechanism.LabelMechanism``: ``values`` (input grid), ``outputs``,
``epsilon``, ``transition_matrix()``, ``expected_loss(prior=None)`` and
``randomize(labels, rng=None)`` (CSPRNG by default; a numpy Generator for reproducible runs).
"""

from core.label_dp.channel import FiniteMechanism, QuantisedChannel
from core.label_dp.errors import (
    InvalidEpsilonError,
    InvalidLabelError,
    InvalidPriorError,
    LabelDPError,
    UnknownLossError,
)
from core.label_dp.exponential import exponential_mechanism
from core.label_dp.grid import LabelGrid, label_grid
from core.label_dp.laplace import ClippedLaplace, clipped_laplace
from core.label_dp.losses import LOSS_NAMES, pointwise_loss
from core.label_dp.mechanism import LabelMechanism, privacy_loss
from core.label_dp.prior import (
    counts_to_prior,
    default_prior_epsilon,
    noisy_counts,
    private_prior,
    split_budget,
)
from core.label_dp.release import LabelRelease, release_labels
from core.label_dp.rr_on_bins import RROnBins, rr_on_bins
from core.label_dp.staircase import staircase_mechanism
from core.label_dp.training import train_on_noisy_labels

__all__ = [
    "LOSS_NAMES",
    "ClippedLaplace",
    "FiniteMechanism",
    "InvalidEpsilonError",
    "InvalidLabelError",
    "InvalidPriorError",
    "LabelDPError",
    "LabelGrid",
    "LabelMechanism",
    "LabelRelease",
    "QuantisedChannel",
    "RROnBins",
    "UnknownLossError",
    "clipped_laplace",
    "counts_to_prior",
    "default_prior_epsilon",
    "exponential_mechanism",
    "label_grid",
    "noisy_counts",
    "pointwise_loss",
    "privacy_loss",
    "private_prior",
    "release_labels",
    "rr_on_bins",
    "split_budget",
    "staircase_mechanism",
    "train_on_noisy_labels",
]
