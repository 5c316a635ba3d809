"""End to end label-DP release with RR-on-Bins and a private prior (the paper's Algorithm 3).

The label holder snaps labels to the public grid, spends ``eps1`` on a noisy histogram,
optimises RR-on-Bins for that estimate with ``eps2 = eps - eps1`` and randomises every label
once. By basic composition the released prior, mechanism and noisy labels are together
``eps``-label-DP; the feature holder may train on them freely (post-processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.label_dp.grid import LabelGrid
from core.label_dp.prior import private_prior, split_budget
from core.label_dp.randomness import RandomSource
from core.label_dp.rr_on_bins import RROnBins, rr_on_bins


@dataclass(frozen=True, eq=False)
class LabelRelease:
    """What leaves the label holder: the noisy labels and the (public) mechanism."""

    noisy_labels: np.ndarray
    mechanism: RROnBins
    prior_epsilon: float
    label_epsilon: float

    @property
    def epsilon(self) -> float:
        return self.prior_epsilon + self.label_epsilon


def release_labels(
    labels: object,
    grid: LabelGrid,
    epsilon: float,
    loss: str,
    *,
    prior_epsilon: float | None = None,
    clip: bool = True,
    rng: RandomSource = None,
) -> LabelRelease:
    """Noisy labels under ``epsilon``-label-DP (see ``prior.split_budget`` for the split).

    ``rng`` only drives the label randomisation; the prior's noise always comes from the
    exact CSPRNG sampler.
    """
    positions = grid.positions(labels, clip=clip)
    eps1, eps2 = split_budget(epsilon, grid.size, len(positions), prior_epsilon)
    prior = private_prior(np.bincount(positions, minlength=grid.size), eps1)
    mechanism = rr_on_bins(grid.points, prior, eps2, loss)
    noisy = mechanism.randomize(grid.points[positions], rng)
    return LabelRelease(noisy, mechanism, eps1, eps2)
