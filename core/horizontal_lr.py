"""Horizontal (row-partitioned) logistic regression: the maths each party and the coordinator run.

Every party holds different rows with the same columns. For the objective

    J(w) = mean over all rows of log-loss  +  (l2 / 2) * ||coefficients||^2

the pooled gradient is the row-count-weighted mean of the parties' own gradients, so the
coordinator only needs a weighted *sum* -- which secure aggregation reveals without showing
any single party's gradient, loss or row count. The intercept is the last weight and is not
penalised.

Two modes: gradient averaging (one gradient per round, identical to centralised full-batch
gradient descent up to fixed-point error) and FedAvg (a few local epochs, then the
row-weighted mean of the model changes).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from scipy.special import expit

from core.secagg import DEFAULT_SCALE_BITS, encode, pack_weighted, secure_weighted_mean
from core.secagg.fixed_point import add_in_ring
from core.secagg.weighted import WeightedAggregate, unpack_weighted

if TYPE_CHECKING:
    from core.dp.distributed import DistributedGaussian

# ---------------------------------------------------------------------------------------------
# Validation of the parties' tables


class PartyTableError(ValueError):
    """A party's table cannot be used; says which party, column and first row."""

    def __init__(
        self, message: str, party: str | None, column: str | None = None, row: int | None = None
    ) -> None:
        super().__init__(message)
        self.party = party
        self.column = column
        self.row = row


class EmptyPartyError(PartyTableError):
    """A party has no rows (it would silently get zero weight)."""


class SchemaMismatchError(PartyTableError):
    """A party's columns differ from the others' (the model would mix different features)."""


class InvalidLabelError(PartyTableError):
    """A label is not 0 or 1."""


class InvalidFeatureError(PartyTableError):
    """A feature value is missing, infinite or not a number."""


def validate_party_tables(
    tables: Mapping[str, pd.DataFrame],
    label: str = "y",
    id_column: str | None = "id",
    allow_missing: bool = False,
) -> list[str]:
    """Check every party's table and return the shared feature columns (first party's order).
    ``allow_missing`` lets null cells through (a job that imputes them before training)."""
    if not tables:
        raise PartyTableError("no party tables were given", party=None)
    reference_party, reference = next(iter(tables.items()))
    features = [c for c in reference.columns if c not in (label, id_column)]
    if not features:
        raise SchemaMismatchError(
            f"party {reference_party!r}: no feature columns besides {label!r} and {id_column!r}",
            party=reference_party,
        )
    for party, table in tables.items():
        _check_schema(party, table, features, reference_party, label, id_column)
        if len(table) == 0:
            raise EmptyPartyError(f"party {party!r}: the table has no rows", party=party)
        for column in features:
            _check_feature_column(party, table, column, id_column, allow_missing)
        _check_labels(party, table, label, id_column)
    return features


def party_arrays(
    table: pd.DataFrame, features: Sequence[str], label: str = "y"
) -> tuple[np.ndarray, np.ndarray]:
    """Feature matrix (in ``features`` order) and 0/1 label vector of a validated table."""
    X = table.loc[:, list(features)].to_numpy(dtype=np.float64)
    y = table[label].to_numpy(dtype=np.float64)
    return X, y


def _check_schema(
    party: str,
    table: pd.DataFrame,
    features: list[str],
    reference_party: str,
    label: str,
    id_column: str | None,
) -> None:
    columns = list(table.columns)
    repeated = sorted({str(c) for c in columns if columns.count(c) > 1})
    if repeated:
        raise SchemaMismatchError(
            f"party {party!r}: columns appear more than once: {repeated}",
            party=party,
            column=repeated[0],
        )
    if label not in columns:
        raise SchemaMismatchError(
            f"party {party!r}: label column {label!r} is missing", party=party, column=label
        )
    missing = [c for c in features if c not in columns]
    if missing:
        raise SchemaMismatchError(
            f"party {party!r}: column {missing[0]!r} is missing (party {reference_party!r} "
            f"has it); all missing: {missing}",
            party=party,
            column=missing[0],
        )
    extra = [c for c in columns if c not in features and c not in (label, id_column)]
    if extra:
        raise SchemaMismatchError(
            f"party {party!r}: column {extra[0]!r} is not in party {reference_party!r}'s "
            f"table; all extra: {extra}",
            party=party,
            column=extra[0],
        )


def _check_feature_column(
    party: str, table: pd.DataFrame, column: str, id_column: str | None, allow_missing: bool
) -> None:
    raw = table[column]
    numeric = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numeric) & ~(allow_missing & raw.isna().to_numpy())
    if bad.any():
        row = int(np.argmax(bad))
        raise InvalidFeatureError(
            f"party {party!r}, column {column!r}, {_describe_row(table, row, id_column)}: "
            f"value {_readable(raw.iloc[row])!r} is not a finite number",
            party=party,
            column=column,
            row=row,
        )


def _check_labels(party: str, table: pd.DataFrame, label: str, id_column: str | None) -> None:
    raw = table[label]
    numeric = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isin(numeric, (0.0, 1.0))
    if bad.any():
        row = int(np.argmax(bad))
        raise InvalidLabelError(
            f"party {party!r}, column {label!r}, {_describe_row(table, row, id_column)}: "
            f"label {_readable(raw.iloc[row])!r} is not 0 or 1",
            party=party,
            column=label,
            row=row,
        )


def _describe_row(table: pd.DataFrame, row: int, id_column: str | None) -> str:
    if id_column is not None and id_column in table.columns:
        return f"row {row} (id={_readable(table[id_column].iloc[row])!r})"
    return f"row {row}"


def _readable(value: object) -> object:
    """Python scalar for messages (``2``, not ``np.int64(2)``)."""
    return value.item() if isinstance(value, np.generic) else value


# ---------------------------------------------------------------------------------------------
# Model maths


def init_model(n_features: int) -> np.ndarray:
    """Zero weights: the objective is convex, so no random start is needed (and none leaks)."""
    if n_features < 1:
        raise ValueError(f"n_features must be positive, got {n_features}")
    return np.zeros(n_features + 1)


def decision_function(weights: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Linear score ``X @ coefficients + intercept``."""
    return X @ weights[:-1] + weights[-1]


def predict_proba(weights: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Probability of label 1."""
    return expit(decision_function(weights, X))


def objective(weights: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float) -> float:
    """Mean log-loss on the rows plus the L2 penalty on the coefficients."""
    scores = decision_function(weights, X)
    log_loss = np.mean(np.logaddexp(0.0, scores) - y * scores)
    return float(log_loss + 0.5 * l2 * weights[:-1] @ weights[:-1])


def gradient(weights: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float) -> np.ndarray:
    """Gradient of :func:`objective`."""
    residual = predict_proba(weights, X) - y
    grad = np.empty_like(weights)
    grad[:-1] = X.T @ residual / len(y) + l2 * weights[:-1]
    grad[-1] = residual.mean()
    return grad


# ---------------------------------------------------------------------------------------------
# Party and coordinator steps


@dataclass(frozen=True)
class LocalUpdate:
    """What a party contributes to one round, before secure aggregation."""

    update: np.ndarray  # gradient (gradient mode) or change of the model (FedAvg mode)
    loss: float  # objective on the party's rows at the weights it received
    n_rows: int  # weight of this party in the mean

    def packed(self) -> np.ndarray:
        """Vector to feed into a secure sum: row-weighted update, loss and row count."""
        return pack_weighted(self.update, float(self.n_rows), self.loss)


def local_gradient(weights: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float) -> LocalUpdate:
    """Gradient-averaging mode: this party's gradient and objective at ``weights``."""
    return LocalUpdate(
        update=gradient(weights, X, y, l2), loss=objective(weights, X, y, l2), n_rows=len(y)
    )


def local_epochs(
    weights: np.ndarray,
    X: np.ndarray,
    y: np.ndarray,
    l2: float,
    learning_rate: float,
    epochs: int,
) -> LocalUpdate:
    """FedAvg mode: ``epochs`` full-batch GD steps on local rows; returns the model change."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    local = weights.copy()
    for _ in range(epochs):
        local -= learning_rate * gradient(local, X, y, l2)
    return LocalUpdate(update=local - weights, loss=objective(weights, X, y, l2), n_rows=len(y))


def apply_mean_gradient(
    weights: np.ndarray, mean_gradient: np.ndarray, learning_rate: float
) -> np.ndarray:
    """Coordinator step in gradient-averaging mode."""
    return weights - learning_rate * mean_gradient


def apply_mean_delta(weights: np.ndarray, mean_delta: np.ndarray) -> np.ndarray:
    """Coordinator step in FedAvg mode."""
    return weights + mean_delta


def next_model(
    weights: np.ndarray, mean_update: np.ndarray, local_epochs: int, learning_rate: float
) -> np.ndarray:
    """The coordinator's update of a round, which every party recomputes to check the broadcast.

    Deterministic (elementwise IEEE operations on the same inputs), so a party holding the
    previous model and the revealed aggregate gets the very same bits.
    """
    if local_epochs == 0:
        return apply_mean_gradient(weights, mean_update, learning_rate)
    return apply_mean_delta(weights, mean_update)


def centralized_gd(
    X: np.ndarray, y: np.ndarray, l2: float, learning_rate: float, iterations: int
) -> np.ndarray:
    """Plain full-batch gradient descent on pooled rows: the reference federated GD must match."""
    weights = init_model(X.shape[1])
    for _ in range(iterations):
        weights = apply_mean_gradient(weights, gradient(weights, X, y, l2), learning_rate)
    return weights


# ---------------------------------------------------------------------------------------------
# Distributed differential privacy (record level, gradient mode)
#
# Under DP a hospital sends ``[sum of clipped per-row gradients, w * sum of clipped per-row
# losses, rows]``; the penalty, which depends on no row, is added after the sum is unmasked.
# Neighbouring tables differ in one row replaced by any other (a hospital's row count is not
# protected, as in sparse LDA's row unit), so the count needs no noise and stays exact.

LOSS_BOUND = 4.0
"""Each row's log-loss is clipped at this under DP (a row beyond it gives its own label a
probability below 0.02): the loss sum carries noise too, so its rows need a bound."""

LOSS_WEIGHT = 0.5
"""Under DP the clipped loss sum is sent times ``clip_norm * LOSS_WEIGHT / LOSS_BOUND``: one
row moves it by at most half a clip norm, so reporting the loss costs 3% more noise."""


def dp_sensitivity(clip_norm: float) -> float:
    """L2 distance one hospital's DP vector moves when one of its rows is replaced by any
    other: ``2C`` for the gradient sum, ``LOSS_WEIGHT C`` for the loss, 0 for the count."""
    return clip_norm * math.hypot(2.0, LOSS_WEIGHT)


def _loss_scale(clip_norm: float) -> float:
    return clip_norm * LOSS_WEIGHT / LOSS_BOUND


def clipped_contribution(
    weights: np.ndarray, X: np.ndarray, y: np.ndarray, clip_norm: float
) -> np.ndarray:
    """A hospital's DP vector before noise: each row's log-loss gradient (intercept included,
    no penalty) clipped to ``clip_norm`` in L2 and summed, the clipped losses, the rows."""
    scores = decision_function(weights, X)
    rows = np.hstack([X, np.ones((len(y), 1))]) * (expit(scores) - y)[:, None]
    norms = np.linalg.norm(rows, axis=1)
    factor = np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))
    losses = np.minimum(np.logaddexp(0.0, scores) - y * scores, LOSS_BOUND)
    loss_sum = _loss_scale(clip_norm) * float(losses.sum())
    return np.concatenate([(rows * factor[:, None]).sum(axis=0), [loss_sum, float(len(y))]])


def dp_loss_sd(
    share_sigma: float, senders: int, rows: float, clip_norm: float, scale_bits: int
) -> float:
    """Standard deviation of a round's DP mean loss: the ``senders``' noise shares (of
    ``share_sigma`` grid steps each) on the loss coordinate, read back as a mean over ``rows``.
    Why: the coordinator's divergence check and warnings must not take noise for a rise."""
    grid = math.ldexp(1.0, scale_bits) * _loss_scale(clip_norm) * rows
    return share_sigma * math.sqrt(senders) / grid


def largest_dp_input(rows: int, clip_norm: float) -> float:
    """Largest coordinate of a DP vector of ``rows`` rows (before scaling to the grid)."""
    return rows * max(clip_norm, 1.0)


def noisy_ring_input(
    vector: np.ndarray,
    noise: DistributedGaussian,
    n_parties: int,
    scale_bits: int,
    clip_norm: float,
    party: str = "this party",
) -> np.ndarray:
    """The DP vector encoded to the secure sum's ring with this party's noise share added
    (every coordinate but the exact row count), once the noisy sum of ``n_parties`` such
    vectors at their largest clipped input is checked not to wrap."""
    from core.dp.distributed import check_ring

    largest = math.ldexp(largest_dp_input(int(vector[-1]), clip_norm), scale_bits)
    check_ring(largest, noise, n_parties)
    share = noise.share(vector.size)
    share[-1] = 0
    return add_in_ring(encode(vector, n_parties, scale_bits, party=party), share)


def round_mean(
    total: np.ndarray, weights: np.ndarray, l2: float, clip_norm: float | None = None
) -> WeightedAggregate:
    """A round's mean update and loss from its unmasked sum, as the coordinator and every
    checking hospital compute them (bit for bit). Without DP: the row-weighted means, as
    before. Under DP: the mean of the clipped gradients plus the penalty's gradient, and the
    (noisy) clipped loss plus the penalty."""
    plain = unpack_weighted(total)
    if clip_norm is None:
        return plain
    coefficients = weights[:-1]
    penalty = np.append(l2 * coefficients, 0.0)
    loss = plain.mean_loss / _loss_scale(clip_norm) + 0.5 * l2 * float(coefficients @ coefficients)
    return WeightedAggregate(plain.mean + penalty, loss, plain.total_weight)


# ---------------------------------------------------------------------------------------------
# In-process federated training (tests, benchmarks)


@dataclass(frozen=True)
class FederatedFit:
    """Trained weights and the securely aggregated objective before each round."""

    weights: np.ndarray
    losses: list[float]


def train_federated(
    parties: Sequence[tuple[np.ndarray, np.ndarray]],
    iterations: int,
    learning_rate: float,
    l2: float,
    epochs_per_round: int = 0,
    threshold: int | None = None,
    scale_bits: int = DEFAULT_SCALE_BITS,
) -> FederatedFit:
    """Train with one secure weighted aggregation per round.

    ``epochs_per_round = 0`` averages gradients (matches :func:`centralized_gd`); a positive
    value runs FedAvg with that many local epochs per round.
    """
    if not parties:
        raise ValueError("at least one party is needed")
    weights = init_model(parties[0][0].shape[1])
    losses: list[float] = []
    job = secrets.token_hex(8)
    for round_index in range(iterations):
        if epochs_per_round == 0:
            updates = [local_gradient(weights, X, y, l2) for X, y in parties]
        else:
            updates = [
                local_epochs(weights, X, y, l2, learning_rate, epochs_per_round) for X, y in parties
            ]
        result = secure_weighted_mean(
            [u.update for u in updates],
            [float(u.n_rows) for u in updates],
            [u.loss for u in updates],
            threshold=threshold,
            scale_bits=scale_bits,
            session_id=f"horizontal-lr/{job}/round-{round_index}",
        )
        aggregate = result.aggregate
        losses.append(aggregate.mean_loss)
        if epochs_per_round == 0:
            weights = apply_mean_gradient(weights, aggregate.mean, learning_rate)
        else:
            weights = apply_mean_delta(weights, aggregate.mean)
    return FederatedFit(weights=weights, losses=losses)
