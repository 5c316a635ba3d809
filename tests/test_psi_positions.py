"""The KKRT16 sender checks what it can of the positions a receiver announces: in range,
strictly ascending (so unique), int64, on its real items (no dummy), and no more than the
receiver holds ids per bucket. (That each is a real match cannot be checked in plain KKRT16;
docs/threat-model.md says what a malicious receiver can make the sender align.)"""

from __future__ import annotations

import numpy as np
import pytest

from core import psi
from core.psi_ot import buckets
from core.psi_ot import protocol as kkrt_psi
from core.psi_ot.primitives import random_key

SENDER_IDS, RECEIVER_IDS = 400, 20


def sender_plan() -> buckets.Plan:
    theirs = kkrt_psi.size_message(RECEIVER_IDS)
    plan = kkrt_psi.plan("bank", "shop", SENDER_IDS, buckets.BUCKET_IDS, theirs)
    assert not plan.receiver and plan.buckets == 1 and plan.peer_padded >= RECEIVER_IDS
    return plan


def rows(key: bytes, plan: buckets.Plan, positions: np.ndarray) -> np.ndarray:
    message = {"positions": positions}  # as it arrives: not re-typed by positions_message
    return kkrt_psi.sender_rows(key, SENDER_IDS, plan, 0, message, "shop")


def real_positions(key: bytes, plan: buckets.Plan, count: int) -> np.ndarray:
    """``count`` ascending positions of the sender's real items (what an honest R may name)."""
    keep: list[int] = []
    for position in range(plan.own_padded):
        try:
            rows(key, plan, np.array([position], dtype=np.int64))
        except psi.PsiError:
            continue  # a dummy
        keep.append(position)
        if len(keep) == count:
            break
    return np.array(keep, dtype=np.int64)


def test_more_positions_than_the_receiver_holds_ids_are_refused() -> None:
    key, plan = random_key(), sender_plan()
    honest = real_positions(key, plan, plan.peer_padded)
    assert len(rows(key, plan, honest)) == plan.peer_padded  # as many as it holds: accepted
    too_many = real_positions(key, plan, plan.peer_padded + 1)
    with pytest.raises(psi.PsiError, match=rf"names {plan.peer_padded + 1} matches, more than"):
        rows(key, plan, too_many)


@pytest.mark.parametrize(
    ("tamper", "refusal"),
    [
        (lambda p: np.array([p[0], p[0], p[1]]), "not strictly ascending"),  # a repeat
        (lambda p: p[::-1].copy(), "not strictly ascending"),
        (lambda p: np.concatenate([np.array([-1], dtype=np.int64), p]), "out of range"),
        (lambda p: p.astype(np.int32), "must be int64"),
        (lambda p: p.reshape(1, -1), "must be int64"),
    ],
)
def test_a_malformed_announcement_is_refused(tamper: object, refusal: str) -> None:
    key, plan = random_key(), sender_plan()
    positions = real_positions(key, plan, 5)
    with pytest.raises(psi.PsiError, match=refusal):
        rows(key, plan, tamper(positions))  # type: ignore[operator]


def test_a_position_beyond_the_padded_bucket_is_refused() -> None:
    key, plan = random_key(), sender_plan()
    with pytest.raises(psi.PsiError, match="out of range"):
        rows(key, plan, np.array([plan.own_padded], dtype=np.int64))
