"""The ``psi_align`` flow under a Prefect test server (the ECDH protocol's messages; the default
KKRT16 protocol has its own module)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from core import psi
from federation.workspace import channel_for
from flows.align import psi_align
from storage import codec
from storage.descriptor import TableRef
from storage.party_store import PartyStore

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]


def make_parties(workspace: Path, shared: int = 150, only_a: int = 40, only_b: int = 60):
    rng = np.random.default_rng(5)
    ids = [f"customer-{rng.integers(10**12)}-{i}" for i in range(shared + only_a + only_b)]
    a_ids, b_ids = ids[: shared + only_a], ids[:shared] + ids[shared + only_a :]
    a = TableRef(
        database=str(workspace / "bank.duckdb"),
        table="accounts",
        label_column="y",
        label_domain=(0, 1),
    )
    b = TableRef(database=str(workspace / "shop.duckdb"), table="orders")
    frame_a = pd.DataFrame(
        {"id": a_ids, "y": rng.integers(0, 2, len(a_ids)), "balance": rng.normal(size=len(a_ids))}
    )
    frame_b = pd.DataFrame({"id": list(reversed(b_ids)), "spend": rng.normal(size=len(b_ids))})
    PartyStore.of(a).import_frame(frame_a, a)
    PartyStore.of(b).import_frame(frame_b, b)
    return a, b, set(a_ids) & set(b_ids)


def test_flow_aligns_both_sides_and_leaks_no_id(workspace: Path) -> None:
    a, b, expected = make_parties(workspace)
    result = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="ecdh")
    assert result["intersection_size"] == len(expected) == 150
    assert result["set_sizes"] == [190, 210]
    aligned_a = PartyStore.of(a).read_table(TableRef.from_dict(result["aligned"][0]))
    aligned_b = PartyStore.of(b).read_table(TableRef.from_dict(result["aligned"][1]))
    assert set(aligned_a["id"]) == expected
    assert aligned_a["id"].tolist() == aligned_b["id"].tolist()

    channel = channel_for(result["job_id"], str(workspace))
    records = channel.log()
    assert {(r.sender, r.receiver, r.kind) for r in records} == {
        ("bank", "shop", "psi_blinded"),
        ("shop", "bank", "psi_blinded"),
        ("bank", "shop", "psi_double"),
        ("shop", "bank", "psi_double"),
    }
    raw = b"".join(channel.read_raw(r) for r in records)
    all_ids = set(pd.concat([aligned_a["id"], PartyStore.of(b).read_table(b)["id"]]))
    all_ids |= set(PartyStore.of(a).read_table(a)["id"])
    assert not any(i.encode() in raw for i in all_ids)
    hashes = {bytes(row) for row in psi.hash_ids(sorted(all_ids))}
    crossed = {bytes(row) for r in records for row in codec.loads(channel.read_raw(r))}
    assert not hashes & crossed  # only blinded points crossed, never a bare id hash


def test_rerun_on_unchanged_inputs_reuses_alignment(workspace: Path) -> None:
    a, b, _ = make_parties(workspace)
    first = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace))
    second = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace))
    assert not first["reused"] and second["reused"]
    assert second["job_id"] == first["job_id"]
    PartyStore.of(b).import_frame(
        pd.DataFrame({"id": ["customer-new"] * 1, "spend": [1.0]}).pipe(
            lambda f: pd.concat([PartyStore.of(b).read_table(b), f])
        ),
        b,
    )
    third = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace))
    assert third["job_id"] != first["job_id"] and not third["reused"]


def test_small_intersection_is_refused(workspace: Path) -> None:
    a, b, _ = make_parties(workspace, shared=30)
    with pytest.raises(psi.PsiError, match="below min_rows=100"):
        psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace))
    assert not PartyStore.of(a).has_table("accounts_aligned")
