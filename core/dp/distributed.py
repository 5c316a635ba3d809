"""Distributed discrete Gaussian noise for a secure sum: each party adds a share, so the sum
the coordinator unmasks is already differentially private and nobody sees it without noise.

The construction is Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism
for Federated Learning with Secure Aggregation" (ICML 2021), step by step:

1. Each party clips its contribution in L2 and scales it to the secure sum's fixed-point
   grid (``x -> round(x 2^s)``); one record moves the integer vector by at most
   ``Delta = 2^s Delta_float + sqrt(D)`` in L2 (deterministic rounding of the party's sum:
   each of the D coordinates' rounding errors moves by less than one step).
2. Each party adds ``N_Z(0, sigma_share^2)`` per coordinate (:mod:`core.dp.samplers`, exact,
   OS CSPRNG) in the ring, *before* masking.
3. The sum of ``m`` shares is within max-divergence ``tau`` of one discrete Gaussian of
   variance ``m sigma_share^2``, ``tau = 10 sum_{k=1}^{m-1} exp(-2 pi^2 sigma_share^2 k/(k+1))``
   (their Proposition on sums of discrete Gaussians); the mechanism is then
   ``rho``-zCDP with ``rho = (Delta / (sqrt(m) sigma_share) + tau sqrt(D))^2 / 2`` (their
   Theorem for the distributed discrete Gaussian). At the grids used here ``sigma_share`` is
   at least 2^10 steps and ``tau`` underflows to zero; :func:`calibrate` still refuses a
   calibration whose ``tau`` term exceeds :data:`TAU_LIMIT` of a grid step.
4. Rounds compose in zCDP (``rho`` adds up; adaptively chosen rounds too) and the total is
   converted to (epsilon, delta) with Canonne, Kamath and Steinke's conversion
   (:func:`core.dp.discrete_privacy.zcdp_sigma`): that is the *proven* calibration. The
   ledger counts each round as the ``vector`` discrete Gaussian of :mod:`core.dp.accounting`
   (sigma of the honest shares, the sensitivity plus one step), all rounds folded into one
   event (:meth:`DistributedGaussian.job_event`); its figure is a little below the target.

Dropouts and collusion use the rule sparse LDA's noise shares follow: sigma is split into
``t - c`` shares (``t`` the fewest senders a sum may have, ``c`` the colluding parties that
can subtract their own shares), so any sum the coordinator can unmask carries at least the
calibrated sigma from parties outside the colluders; more senders add more noise.

The ring: the noisy sum must not wrap around 2^64. :func:`ring_bits` counts the bits the
largest clipped input plus a noise bound (exceeded with probability below
:data:`WRAP_FAILURE` over the whole job, by the discrete Gaussian's sub-Gaussian tail) need,
and :func:`check_ring` refuses a job that needs more than the ring has. A wrap would only
cost accuracy (it is a function of the noisy sum), never privacy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from core.dp.discrete_privacy import zcdp_sigma
from core.dp.errors import PrivacyParameterError
from core.dp.samplers import sample_discrete_gaussian
from core.secagg.fixed_point import RING_BITS

if TYPE_CHECKING:  # the accountant loads dp-accounting: imported where an event is built
    from core.dp.accounting import DiscreteGaussian

TAU_LIMIT = 1e-9
"""Largest ``tau sqrt(D) sigma`` (in grid steps) a calibration accepts; the ledger's one-step
margin covers it many times over."""

WRAP_FAILURE = 2.0**-40
"""Chance, over every coordinate of every round of a job, that the noise exceeds the bound
the ring is sized for."""

MIN_SHARE_STEPS = 1024.0
"""Least sigma of one share in grid steps: far above the 1/2 Kairouz et al.'s bound needs, and
the grid the ledger's ``vector`` event requires of the total."""


class RingOverflowError(PrivacyParameterError):
    """The noisy sum could wrap around the ring: refused before anything is computed or sent."""


def honest_shares(threshold: int, colluding: int) -> int:
    """Shares every unmaskable sum holds that no tolerated colluder knows: ``t - c``."""
    if not 0 <= colluding < threshold:
        raise PrivacyParameterError(
            f"colluding parties must be in [0, threshold - 1 = {threshold - 1}], got "
            f"{colluding}: the shares of the others must still add up to the calibrated sigma"
        )
    return threshold - colluding


def kairouz_tau(share_sigma: float, shares: int) -> float:
    """``tau`` of Kairouz et al.: how far a sum of ``shares`` discrete Gaussians of
    ``share_sigma`` (grid steps) is from one discrete Gaussian, in max-divergence."""
    factor = -2.0 * (math.pi * share_sigma) ** 2
    return 10.0 * sum(math.exp(factor * k / (k + 1)) for k in range(1, shares))


def grid_sensitivity(float_sensitivity: float, scale_bits: int, dimension: int) -> float:
    """Step 1: the L2 sensitivity on the fixed-point grid, rounding included."""
    return math.ldexp(float_sensitivity, scale_bits) + math.sqrt(dimension)


@dataclass(frozen=True)
class DistributedGaussian:
    """A job's noise, in grid steps: what every party's share is and what every sum holds."""

    sensitivity: float  # L2, per round, in grid steps (rounding included)
    sigma: float  # the least any unmaskable sum carries from parties outside the colluders
    share_sigma: float  # one party's share: sigma / sqrt(honest)
    honest: int  # t - c
    rounds: int
    dimension: int

    def rho(self) -> float:
        """zCDP of the whole job (Kairouz et al.'s Theorem, composed over the rounds)."""
        tau = kairouz_tau(self.share_sigma, self.honest)
        per_round = (self.sensitivity / self.sigma + tau * math.sqrt(self.dimension)) ** 2 / 2
        return self.rounds * per_round

    def round_event(self) -> DiscreteGaussian:
        """One round as the ledger books it (a ``vector`` discrete Gaussian of sigma)."""
        from core.dp.accounting import DiscreteGaussian

        return DiscreteGaussian(self.sensitivity, self.sigma, "vector")

    def job_event(self) -> DiscreteGaussian:
        """Every round of the job as one event, booked once before the first noisy sum leaves.

        The ledger counts a ``vector`` discrete Gaussian as the continuous Gaussian of ``(its
        sensitivity + 1) / sigma``, and Gaussians compose exactly into one whose squared ratios
        add up; so the rounds are the one event of sensitivity ``sqrt(rounds) (Delta + 1) - 1``
        at the same sigma: the same figure as :meth:`round_event` composed ``rounds`` times,
        in one line of ``privreg budget show``."""
        from core.dp.accounting import DiscreteGaussian

        folded = math.sqrt(self.rounds) * (self.sensitivity + 1.0) - 1.0
        return DiscreteGaussian(folded, self.sigma, "vector")

    def share(self, size: int) -> np.ndarray:
        """One party's noise share (int64), exact and from the OS CSPRNG (step 2)."""
        return sample_discrete_gaussian(self.share_sigma, size)

    def noise_bound(self) -> float:
        """A bound one share exceeds, in any coordinate of any round, with probability below
        :data:`WRAP_FAILURE` (sub-Gaussian tail ``P[|X| > k sigma] <= 2 exp(-k^2 / 2)``)."""
        draws = self.dimension * self.rounds
        k = math.sqrt(2.0 * math.log(2.0 * draws / WRAP_FAILURE))
        return k * self.share_sigma


def calibrate(
    epsilon: float,
    delta: float,
    sensitivity: float,
    rounds: int,
    honest: int,
    dimension: int,
) -> DistributedGaussian:
    """Step 4: the least sigma (grid steps) whose ``rounds`` composed give (epsilon, delta)
    by the proven zCDP bound, split into ``honest`` shares; refuses a share below
    :data:`MIN_SHARE_STEPS` (a grid too coarse for the noise) or a non-negligible ``tau``."""
    if rounds < 1 or honest < 1 or dimension < 1:
        raise PrivacyParameterError(
            f"need rounds, honest shares and dimension >= 1, got {rounds}, {honest}, {dimension}"
        )
    margin = sensitivity + 1.0  # the ledger's one-step margin, which also covers tau
    sigma = zcdp_sigma(epsilon, delta, math.sqrt(rounds) * margin)
    share = sigma / math.sqrt(honest)
    if share < MIN_SHARE_STEPS:
        raise PrivacyParameterError(
            f"a noise share of {share:.4g} grid steps is below {MIN_SHARE_STEPS:g}: use a "
            "finer fixed-point scale or a smaller epsilon"
        )
    noise = DistributedGaussian(margin - 1.0, sigma, share, honest, rounds, dimension)
    if kairouz_tau(share, honest) * math.sqrt(dimension) * sigma > TAU_LIMIT:
        raise PrivacyParameterError("the shares' tau term is not negligible; refused")
    return noise


def ring_bits(largest_input: float, noise: DistributedGaussian, parties: int) -> int:
    """Bits a signed ring needs so that ``parties`` inputs of at most ``largest_input`` grid
    steps per coordinate, each with its share, cannot wrap (but with :data:`WRAP_FAILURE`)."""
    per_party = abs(largest_input) + noise.noise_bound()
    return math.ceil(math.log2(parties * per_party + 1.0)) + 1


def check_ring(
    largest_input: float, noise: DistributedGaussian, parties: int, ring: int = RING_BITS
) -> int:
    """:func:`ring_bits`, refused above the ``ring``'s bits (before anything is sent)."""
    needed = ring_bits(largest_input, noise, parties)
    if needed > ring:
        raise RingOverflowError(
            f"the noisy sum of {parties} parties needs a {needed}-bit ring, more than the "
            f"secure sum's {ring}: lower the fixed-point scale, the clip norm or the rows"
        )
    return needed
