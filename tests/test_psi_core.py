"""The PSI protocol equals the plaintext set intersection, and aligns rows identically."""

from __future__ import annotations

import numpy as np
import pytest

from core import psi
from core.ids import canonical_id


def run_protocol(a: list[object], b: list[object], workers: int = 1):
    key_a, key_b = psi.new_key(), psi.new_key()
    sent_a, sent_b = psi.prepare(a, key_a, workers), psi.prepare(b, key_b, workers)
    a_double = psi.reblind(sent_a.blinded, key_b, workers)  # computed by B, returned to A
    b_double = psi.reblind(sent_b.blinded, key_a, workers)  # computed by A, returned to B
    return (
        psi.intersect(a_double, sent_a.rows, b_double),
        psi.intersect(b_double, sent_b.rows, a_double),
    )


def assert_matches_plaintext(a: list[object], b: list[object]) -> None:
    result_a, result_b = run_protocol(a, b)
    expected = psi.plaintext_intersection(a, b)
    assert {canonical_id(a[i]) for i in result_a.rows} == expected
    assert {canonical_id(b[i]) for i in result_b.rows} == expected
    # the same order on both sides: row k of A's aligned table is row k of B's
    assert [canonical_id(a[i]) for i in result_a.rows] == [
        canonical_id(b[j]) for j in result_b.rows
    ]
    assert (result_a.own_size, result_a.peer_size) == (len(a), len(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sets(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool = rng.choice(10**9, size=3000, replace=False)
    a = [int(x) for x in rng.choice(pool, 1200, replace=False)]
    b = [int(x) for x in rng.choice(pool, 1500, replace=False)]
    assert_matches_plaintext(a, b)


def test_mixed_types_match_by_the_documented_rule() -> None:
    a = [7, "8", 9.0, "  10 ", "x-1", "007"]
    b = ["7", 8, "9", 10, "X-1", 11]
    result_a, _ = run_protocol(a, b)
    assert sorted(a[i] for i in result_a.rows if isinstance(a[i], int)) == [7]
    assert {canonical_id(a[i]) for i in result_a.rows} == {b"7", b"8", b"9", b"10"}


def test_unicode_is_normalised() -> None:
    composed, decomposed = "Jos\u00e9", "Jose\u0301"
    a = [composed, "\u6771\u4eac", "\U0001f600", "plain"]
    b = [decomposed, "\u6771\u4eac", "\U0001f600 ", "other"]
    result_a, _ = run_protocol(a, b)
    assert sorted(result_a.rows.tolist()) == [0, 1, 2]


def test_no_overlap_and_full_overlap() -> None:
    result_a, _ = run_protocol(list(range(100)), list(range(100, 250)))
    assert result_a.size == 0
    with pytest.raises(psi.PsiError, match="empty"):
        psi.check_release(result_a, min_rows=1)
    ids = [f"user-{i}" for i in range(300)]
    result_a, result_b = run_protocol(ids, list(reversed(ids)))
    assert result_a.size == result_b.size == 300


def test_small_intersection_is_refused() -> None:
    result_a, _ = run_protocol(list(range(150)), list(range(60, 400)))
    assert result_a.size == 90
    with pytest.raises(psi.PsiError, match="below min_rows=100"):
        psi.check_release(result_a, min_rows=100)
    psi.check_release(result_a, min_rows=90)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 2, None], "row 3: id is null"),
        ([1, float("nan")], "row 2: id is null"),
        (["a", "b", "a"], "row 3 duplicates row 1"),
        ([7, "7"], "row 2 duplicates row 1"),
        ([1, 2.5], "row 2: float id 2.5 is not an integer"),
        ([True], "boolean"),
        (["  "], "empty string"),
    ],
)
def test_adversarial_inputs_are_refused(ids: list[object], message: str) -> None:
    with pytest.raises(psi.PsiError, match=message):
        psi.hash_ids(ids)


def test_parallel_blinding_equals_serial() -> None:
    points = psi.hash_ids(list(range(25_000)))
    key = psi.new_key()
    assert np.array_equal(psi.blind(points, key, workers=1), psi.blind(points, key, workers=2))


def test_blinding_commutes_and_hides_hashes() -> None:
    points = psi.hash_ids(["alice", "bob"])
    x, y = psi.new_key(), psi.new_key()
    once = psi.blind(points, x)
    assert not np.array_equal(once, points)
    assert np.array_equal(psi.blind(once, y), psi.blind(psi.blind(points, y), x))
