"""Label-DP regression maths: RR-on-Bins, its private prior, and baseline mechanisms.

Every mechanism follows ``mechanism.LabelMechanism``: ``values`` (input grid), ``outputs``,
``epsilon``, ``transition_matrix()``, ``expected_loss(prior=None)`` and
``randomize(labels, rng=None)`` (CSPRNG by default; a numpy Generator for reproducible runs).
"""

from core.lazy import lazy_exports

_WHERE = {  # name -> the module that defines it, imported on first use
    "clipped_laplace": "core.label_dp.laplace",
    "ClippedLaplace": "core.label_dp.laplace",
    "counts_to_prior": "core.label_dp.prior",
    "default_prior_epsilon": "core.label_dp.prior",
    "exponential_mechanism": "core.label_dp.exponential",
    "FiniteMechanism": "core.label_dp.channel",
    "InvalidEpsilonError": "core.label_dp.errors",
    "InvalidLabelError": "core.label_dp.errors",
    "InvalidPriorError": "core.label_dp.errors",
    "label_grid": "core.label_dp.grid",
    "LabelDPError": "core.label_dp.errors",
    "LabelGrid": "core.label_dp.grid",
    "LabelMechanism": "core.label_dp.mechanism",
    "LabelRelease": "core.label_dp.release",
    "LOSS_NAMES": "core.label_dp.losses",
    "noisy_counts": "core.label_dp.prior",
    "pointwise_loss": "core.label_dp.losses",
    "privacy_loss": "core.label_dp.mechanism",
    "private_prior": "core.label_dp.prior",
    "QuantisedChannel": "core.label_dp.channel",
    "release_labels": "core.label_dp.release",
    "rr_on_bins": "core.label_dp.rr_on_bins",
    "RROnBins": "core.label_dp.rr_on_bins",
    "split_budget": "core.label_dp.prior",
    "staircase_mechanism": "core.label_dp.staircase",
    "train_on_noisy_labels": "core.label_dp.training",
    "UnknownLossError": "core.label_dp.errors",
}

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


__getattr__ = lazy_exports(__name__, _WHERE)
