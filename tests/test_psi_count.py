"""Cardinality-only PSI: the count equals the plaintext intersection's size, the shuffled
answer cannot be mapped back to rows, and the flow writes no table."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.artifacts import Artifact
from test_psi_flow import make_parties

from core import psi, psi_count
from core.preprocessing import PreprocessingSpec
from federation.workspace import channel_for
from flows.psi_count import psi_count as psi_count_flow
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks.reporting import short_id


def run_count(a: list[object], b: list[object]) -> tuple[psi_count.Cardinality, ...]:
    key_a, key_b = psi.new_key(), psi.new_key()
    sent_a, sent_b = psi.prepare(a, key_a, 1), psi.prepare(b, key_b, 1)
    to_a = psi_count.answer(sent_a.blinded, key_b)  # computed by B
    to_b = psi_count.answer(sent_b.blinded, key_a)  # computed by A
    return psi_count.count(to_a, len(a), to_b), psi_count.count(to_b, len(b), to_a)


@pytest.mark.parametrize(
    ("a", "b"),
    [(list(range(300)), list(range(200, 700))), ([7], [8]), ([7], ["7"]), (["x"] * 0, [1, 2])],
)
def test_count_equals_the_plaintext_intersection(a: list[object], b: list[object]) -> None:
    left, right = run_count(a, b)
    expected = len(psi.plaintext_intersection(a, b))
    assert left.size == right.size == expected
    assert (left.own_size, left.peer_size) == (len(a), len(b))


def test_the_answer_is_shuffled_not_in_the_order_sent() -> None:
    ids = [f"p-{i}" for i in range(500)]
    key_a, key_b = psi.new_key(), psi.new_key()
    sent = psi.prepare(ids, key_a, 1)
    in_order = psi.reblind(sent.blinded, key_b)  # what the aligning protocol returns
    shuffled = psi_count.answer(sent.blinded, key_b)
    assert sorted(map(bytes, shuffled)) == sorted(map(bytes, in_order))
    assert [bytes(row) for row in shuffled] == sorted(bytes(row) for row in shuffled)
    moved = sum(bytes(x) != bytes(y) for x, y in zip(shuffled, in_order, strict=True))
    assert moved > 490  # position k no longer answers row k's id


def test_malformed_answers_are_refused_naming_the_peer() -> None:
    key = psi.new_key()
    sent = psi.prepare(list(range(20)), key, 1)
    answer = psi_count.answer(sent.blinded, psi.new_key())
    with pytest.raises(psi.PsiError, match="from shop has 19 values for the 20 ids sent"):
        psi_count.count(answer[:-1], 20, answer, "shop")
    repeated = answer.copy()
    repeated[3] = repeated[4]
    with pytest.raises(psi.PsiError, match="shuffled answer from shop repeats the point"):
        psi_count.count(repeated, 20, answer, "shop")


@pytest.mark.usefixtures("prefect_server")
def test_flow_counts_writes_no_table_and_guards_small_counts(workspace: Path) -> None:
    a, b, expected = make_parties(workspace)
    result = psi_count_flow(a.to_dict(), b.to_dict(), workspace=str(workspace))
    assert result["intersection_size"] == len(expected) == 150
    assert result["set_sizes"] == [190, 210] and not result["reused"]
    assert not PartyStore.of(a).has_table("accounts_aligned")
    assert not PartyStore.of(b).has_table("orders_aligned")
    kinds = {r.kind for r in channel_for(result["job_id"], str(workspace)).log()}
    assert kinds == {"psi_count_blinded", "psi_count_answer"}
    summary = Artifact.get(f"accounts-psi-count-{short_id(result['job_id'])}-summary")
    assert summary is not None and "| shared rows | 150 |" in summary.data  # one summary per run
    assert psi_count_flow(a.to_dict(), b.to_dict(), workspace=str(workspace))["reused"]
    with pytest.raises(psi.PsiError, match="fewer than min_rows=151"):
        psi_count_flow(a.to_dict(), b.to_dict(), min_rows=151, workspace=str(workspace))


@pytest.mark.usefixtures("prefect_server")
def test_a_count_reads_only_the_ids_so_missing_feature_cells_are_no_refusal(
    workspace: Path,
) -> None:
    """As the aligning PSI: a table stored for a job that imputes may hold missing cells."""
    a, b, expected = make_parties(workspace, shared=120)
    gappy = TableRef(database=str(workspace / "lab.duckdb"), table="tests")
    frame = PartyStore.of(b).read_table(b).assign(spend=lambda f: f["spend"].mask(f.index < 5))
    assert frame["spend"].isna().sum() == 5
    PartyStore.of(gappy).import_frame(frame, gappy, PreprocessingSpec(impute="mean"))
    result = psi_count_flow(a.to_dict(), gappy.to_dict(), workspace=str(workspace))
    assert result["intersection_size"] == len(expected) == 120
