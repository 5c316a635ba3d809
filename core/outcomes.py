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
#: Held-out AUC at or below 0.5 + this margin is no better than guessing.
AUC_MARGIN = 0.02
#: The state name a flow returns for a model below its baseline (still COMPLETED).
BELOW_BASELINE = "Below baseline"


class DivergenceError(RuntimeError):
    """Training diverged (non-finite or exploding loss); names the round and what to change."""

    def __init__(self, flow: str, job_id: str, round_: int, loss: float, first: float) -> None:
        self.round, self.loss, self.first = round_, loss, first
        what = "is not finite" if not math.isfinite(loss) else f"rose to {loss:.4g}"
        super().__init__(
            f"{flow} {job_id} diverged in round {round_}: the training loss {what} (first "
            f"round {first:.4g}). Lower learning_rate (e.g. to a tenth), keep preprocessing."
            "scaling at 'standard' (raw features of very different sizes make steps overshoot),"
            " or clip features"
        )


def check_loss(flow: str, job_id: str, round_: int, loss: float, first: float | None) -> None:
    """Raise :class:`DivergenceError` when ``loss`` is non-finite or far above ``first``."""
    if not math.isfinite(loss) or (first is not None and loss > first + LOSS_RISE_LIMIT):
        raise DivergenceError(flow, job_id, round_, loss, first if first is not None else loss)


def rising(losses: list[float], window: int = 3) -> bool:
    """The last ``window`` losses each rose: the steps are too large, worth a warning."""
    tail = losses[-(window + 1) :]
    return len(tail) == window + 1 and all(b > a for a, b in itertools.pairwise(tail))


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
