"""What a training run's numbers say about it: diverged, below its baseline, or fine.

A diverging run must stop at once with an error that says where and what to change, rather
than finish COMPLETED with a warning; a model that predicts no better than the class prior
must end in a state a person notices. Plain rules on plain numbers, shared by every flow.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

#: A log-loss this far above the run's first loss means the steps overshoot (log 2 = 0.69 at
#: a zero start, so the limit is about 5.7, far beyond any loss a learning model returns to).
LOSS_RISE_LIMIT = 5.0
#: Under DP a round's loss carries noise: a rise within this many standard deviations of the
#: difference of two noisy losses is noise, not divergence (a false stop about 1e-9 a round).
NOISE_SDS = 6.0
#: ... and a rise counts towards "rising" only beyond this many (about 8% a round by chance).
RISE_SDS = 2.0
#: Held-out AUC at or below 0.5 + this margin is no better than guessing.
AUC_MARGIN = 0.02
#: The state name a flow returns for a model below its baseline (still COMPLETED).
BELOW_BASELINE = "Below baseline"


class DivergenceError(RuntimeError):
    """Training diverged (non-finite or exploding loss, or values past the encoding's range
    before the loss could say so); names the round and what to change."""

    def __init__(
        self,
        flow: str,
        job_id: str,
        round_: int,
        loss: float,
        first: float,
        cause: str | None = None,
    ) -> None:
        self.round, self.loss, self.first = round_, loss, first
        if cause is None:
            what = "is not finite" if not math.isfinite(loss) else f"rose to {loss:.4g}"
            cause = f"the training loss {what} (first round {first:.4g})"
        super().__init__(
            f"{flow} {job_id} diverged in round {round_}: {cause}. Lower learning_rate (e.g. "
            "to a tenth), keep preprocessing.scaling at 'standard' (raw features of very "
            "different sizes make steps overshoot), or clip features"
        )


def noise_margin(noise_sd: float, sds: float) -> float:
    """How far one noisy loss may lie above another by noise alone: ``sds`` standard deviations
    of their difference (each carries noise of ``noise_sd``; 0 without DP)."""
    return sds * math.sqrt(2.0) * noise_sd


def check_loss(
    flow: str, job_id: str, round_: int, loss: float, first: float | None, noise_sd: float = 0.0
) -> None:
    """Raise :class:`DivergenceError` when ``loss`` is non-finite or far above ``first``, by
    more than DP noise of ``noise_sd`` (per loss) explains."""
    limit = LOSS_RISE_LIMIT + noise_margin(noise_sd, NOISE_SDS)
    if not math.isfinite(loss) or (first is not None and loss > first + limit):
        raise DivergenceError(flow, job_id, round_, loss, first if first is not None else loss)


def rising(losses: list[float], window: int = 3, noise_sd: float = 0.0) -> bool:
    """The last ``window`` losses each rose, each by more than DP noise of ``noise_sd`` would:
    the steps are too large, worth a warning."""
    tail, margin = losses[-(window + 1) :], noise_margin(noise_sd, RISE_SDS)
    return len(tail) == window + 1 and all(b > a + margin for a, b in itertools.pairwise(tail))


@dataclass(frozen=True)
class Verdict:
    """Whether held-out quality beats the baseline, and why not."""

    below_baseline: bool
    reasons: tuple[str, ...]

    @property
    def line(self) -> str:
        return "; ".join(self.reasons) if self.reasons else "above baseline"


def classifier_verdict(metrics: Mapping[str, float | None]) -> Verdict:
    """Held-out AUC at most 0.5 + AUC_MARGIN, or held-out log-loss at least the prior's,
    means below baseline. Missing figures decide nothing."""
    reasons = []
    auc = metrics.get("holdout_auc")
    if auc is not None and auc <= 0.5 + AUC_MARGIN:
        reasons.append(f"held-out AUC {auc:.4f} <= {0.5 + AUC_MARGIN:g}")
    loss, prior = metrics.get("holdout_log_loss"), metrics.get("holdout_prior_log_loss")
    if loss is not None and prior is not None and loss >= prior:
        reasons.append(f"held-out log-loss {loss:.4f} >= the class prior's {prior:.4f}")
    return Verdict(bool(reasons), tuple(reasons))
