"""The plaintext parts of each party's step, shared by the encrypted protocol and the reference.

Labels are in {-1, +1}. With the Taylor expansion of the logistic loss around 0,
``log(1 + e^(-y wx)) ~ log 2 - y wx / 2 + (wx)^2 / 8``, the per-row gradient factor is
``d = wx/4 - y/2``, which is linear in every party's score ``u_p = X_p w_p``: hosts can send
their share encrypted and the guest can add its own in the clear. In integers at
``RESIDUAL_BITS``: a host sends ``a_h = round(u_h/4 * 2^24)``; the guest adds
``b = round((u_g/4 - y/2) * 2^24)``; ``d = sum(a_h) + b``.

The loss uses ``z = wx/4`` (``z_int = sum(a_h) + q`` with ``q = round(u_g/4 * 2^24)``):
per row ``log 2 - 2 y z + 2 z^2``, so the batch total is
``n log 2 + 2 * S / 2^48`` with ``S = sum(z_int^2) - 2^24 * sum(y z_int)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from core.vertical_lr.fixed_point import RESIDUAL_BITS, decode_gradient, encode_residual

SCALE = 2**RESIDUAL_BITS


def host_share(X_batch: np.ndarray, weights: np.ndarray) -> list[int]:
    """A host's ``round(u_h / 4 * 2^24)`` for the batch rows."""
    return encode_residual(X_batch @ weights / 4.0)


def guest_shares(
    X_batch: np.ndarray, weights: np.ndarray, y_pm1: np.ndarray
) -> tuple[list[int], list[int]]:
    """The guest's residual part ``b`` and its loss part ``q`` for the batch rows."""
    scores = X_batch @ weights
    return encode_residual(scores / 4.0 - y_pm1 / 2.0), encode_residual(scores / 4.0)


def loss_coefficients(q: list[int], y_pm1: np.ndarray) -> tuple[list[int], int]:
    """How the guest folds the hosts' encrypted ``A = sum(a_h)`` into ``S``.

    ``S = sum(q^2) - 2^24 sum(y q) + sum_i (2 q_i - 2^24 y_i) A_i + sum(A^2)``; returns the
    per-row coefficients of ``A`` and the plaintext constant.
    """
    y = [int(v) for v in y_pm1]
    coefficients = [2 * qi - SCALE * yi for qi, yi in zip(q, y, strict=True)]
    constant = sum(qi * qi for qi in q) - SCALE * sum(qi * yi for qi, yi in zip(q, y, strict=True))
    return coefficients, constant


def decode_loss(total: int, n_rows: int) -> float:
    """Mean Taylor loss of a batch from the decrypted ``S``."""
    return math.log(2.0) + 2.0 * total / (n_rows * float(SCALE) ** 2)


def labels_pm1(y01: np.ndarray) -> np.ndarray:
    return np.where(np.asarray(y01) > 0, 1, -1).astype(np.int64)


@dataclass
class Optimizer:
    """Mini-batch gradient descent with optional heavy-ball momentum and 1/(1+decay*epoch) steps.

    Its state (the velocity) is part of each round's checkpoint.
    """

    learning_rate: float = 0.15
    momentum: float = 0.0
    decay: float = 0.0
    l2: float = 0.0
    velocity: dict[str, np.ndarray] = field(default_factory=dict)

    def step(
        self,
        name: str,
        weights: np.ndarray,
        gradient_sum: list[int],
        n_rows: int,
        epoch: int,
        penalised: np.ndarray,
    ) -> np.ndarray:
        """New weights of one party from its unmasked ``X^T d`` integers."""
        gradient = decode_gradient(gradient_sum, n_rows) + self.l2 * weights * penalised
        velocity = self.momentum * self.velocity.get(name, np.zeros_like(weights)) + gradient
        self.velocity[name] = velocity
        rate = self.learning_rate / (1.0 + self.decay * epoch)
        return weights - rate * velocity


def exact_dot(X_int: np.ndarray, d: list[int]) -> list[int]:
    """``X^T d`` in exact integers (the plaintext twin of the encrypted product)."""
    column_major = np.asarray(X_int, dtype=object).T
    return [int(v) for v in column_major.dot(np.asarray(d, dtype=object))]
