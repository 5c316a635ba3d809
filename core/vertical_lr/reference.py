"""The vertical protocol's arithmetic in the clear, for tests and benchmarks.

It computes, on pooled data, exactly the integers the encrypted protocol computes (same
schedule, same rounding, same optimizer), so encrypted training must reproduce its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.vertical_lr.fixed_point import encode_features
from core.vertical_lr.schedule import Schedule
from core.vertical_lr.steps import (
    Optimizer,
    decode_loss,
    exact_dot,
    guest_shares,
    host_share,
    labels_pm1,
    loss_coefficients,
)


@dataclass
class ReferenceResult:
    guest_weights: np.ndarray  # intercept first
    host_weights: list[np.ndarray]
    losses: list[float]  # per round


def with_intercept(X: np.ndarray) -> np.ndarray:
    return np.hstack([np.ones((len(X), 1)), np.asarray(X, dtype=float)])


def taylor_loss(
    Xg: np.ndarray, wg: np.ndarray, Xhs: list[np.ndarray], whs: list[np.ndarray], y: np.ndarray
) -> float:
    """Mean Taylor loss of the given rows, by the protocol's integer route."""
    a_total = [
        sum(col)
        for col in zip(*(host_share(X, w) for X, w in zip(Xhs, whs, strict=True)), strict=True)
    ]
    _, q = guest_shares(Xg, wg, y)
    coefficients, constant = loss_coefficients(q, y)
    total = constant + sum(c * a for c, a in zip(coefficients, a_total, strict=True))
    total += sum(a * a for a in a_total)
    return decode_loss(total, len(y))


def train_reference(
    guest_X: np.ndarray,
    host_Xs: list[np.ndarray],
    y01: np.ndarray,
    schedule: Schedule,
    epochs: int,
    optimizer: Optimizer,
) -> ReferenceResult:
    """Train on pooled data with the protocol's exact integer arithmetic."""
    Xg = with_intercept(guest_X)
    y = labels_pm1(y01)
    wg = np.zeros(Xg.shape[1])
    whs = [np.zeros(X.shape[1]) for X in host_Xs]
    Xg_int = encode_features(Xg)
    Xh_ints = [encode_features(X) for X in host_Xs]
    penalised_g = np.r_[0.0, np.ones(Xg.shape[1] - 1)]
    losses = []
    for epoch in range(epochs):
        for index in range(schedule.batches_per_epoch):
            rows = schedule.batch(epoch, index)
            shares = [host_share(X[rows], w) for X, w in zip(host_Xs, whs, strict=True)]
            a_total = [sum(col) for col in zip(*shares, strict=True)]
            b, _ = guest_shares(Xg[rows], wg, y[rows])
            d = [a + bi for a, bi in zip(a_total, b, strict=True)]
            losses.append(taylor_loss(Xg[rows], wg, [X[rows] for X in host_Xs], whs, y[rows]))
            wg = optimizer.step(
                "guest", wg, exact_dot(Xg_int[rows], d), len(rows), epoch, penalised_g
            )
            whs = [
                optimizer.step(
                    f"host{h}", w, exact_dot(X_int[rows], d), len(rows), epoch, np.ones_like(w)
                )
                for h, (w, X_int) in enumerate(zip(whs, Xh_ints, strict=True))
            ]
    return ReferenceResult(wg, whs, losses)
