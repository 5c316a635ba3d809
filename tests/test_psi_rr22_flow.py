"""``psi_align`` with ``protocol: "rr22"`` under Prefect: the same intersection, in the same
order on both sides, as KKRT16's; many buckets with a resume mid-way; a small set meeting many
buckets with one table; nothing of the job left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_psi_flow import make_parties

from core.psi_ot import buckets, rr22
from core.psi_ot import protocol as kkrt
from federation.workspace import channel_for
from flows.align import psi_align
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import psi_kkrt, psi_rr22

pytestmark = pytest.mark.usefixtures("prefect_server")


def _ids(ref: TableRef, result: dict, index: int) -> list[str]:
    aligned = TableRef.from_dict(result["aligned"][index])
    return PartyStore.of(ref).read_table(aligned)["id"].tolist()


def _both(a: TableRef, b: TableRef, job: str, workspace: Path) -> list[list[str]]:
    """Both sides of an RR22 job with a given id; each side's aligned ids."""
    result = psi_align(
        a.to_dict(), b.to_dict(), workspace=str(workspace), job_id=job, protocol="rr22"
    )
    return [_ids(a, result, 0), _ids(b, result, 1)]


def test_rr22_flow_aligns_like_kkrt_and_leaks_no_id(workspace: Path) -> None:
    a, b, expected = make_parties(workspace)
    result = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="rr22")
    assert result["intersection_size"] == len(expected) == 150
    assert result["set_sizes"] == [190, 210]
    rr22_a, rr22_b = _ids(a, result, 0), _ids(b, result, 1)
    assert rr22_a == rr22_b and set(rr22_a) == expected  # one order on both sides
    assert not [k for k in psi_kkrt.JOB_KEYS if k[1] == result["job_id"]]  # one for both
    assert rr22._pairs.cache_info().currsize == rr22._chosen.cache_info().currsize == 0
    assert not (psi_rr22._RECEIVER_STATES or psi_rr22._SENDER_SHARES or psi_rr22._RECEIVER_VOLES)

    channel = channel_for(result["job_id"], str(workspace))
    records = channel.log()
    assert sorted((r.sender, r.kind, r.round) for r in records) == sorted(
        [
            ("bank", kkrt.KIND_SIZE, 0),
            ("shop", kkrt.KIND_SIZE, 0),
            ("bank", rr22.KIND_HELLO, 0),
            ("shop", rr22.KIND_REPLY, 0),
            ("bank", rr22.KIND_EXTEND, 0),
            ("shop", rr22.KIND_VOLE, 0),
            ("bank", rr22.KIND_OKVS, 0),
            ("shop", rr22.KIND_VALUES, 0),
            ("bank", rr22.KIND_RESULT, 0),
            ("bank", rr22.KIND_MATCHED, 0),
        ]
    )  # bank has the smaller set (190 < 210): it is the receiver
    raw = b"".join(channel.read_raw(r) for r in records)
    everyone = set(PartyStore.of(a).read_table(a)["id"]) | set(PartyStore.of(b).read_table(b)["id"])
    assert not any(i.encode() in raw for i in everyone)
    digests = kkrt.item_digests(sorted(everyone), "test")
    assert not any(d[:15].tobytes() in raw for d in digests)

    again = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="rr22")
    assert again["reused"] and again["job_id"] == result["job_id"]
    kkrt_run = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="kkrt")
    assert kkrt_run["job_id"] != result["job_id"]  # one job per protocol
    assert set(_ids(a, kkrt_run, 0)) == set(rr22_a) and kkrt_run["intersection_size"] == 150


class KilledError(ValueError):
    """The party's process ending mid-way (a ValueError: the step is not retried)."""


def test_many_buckets_and_a_resume(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, expected = make_parties(workspace, shared=300, only_a=100, only_b=200)
    monkeypatch.setattr(buckets, "BUCKET_IDS", 64)  # 500 ids at the larger side: 8 buckets
    real, matched = rr22.match, []

    def match(*args):
        if len(matched) == 3:
            raise KilledError("killed while matching")
        matched.append(1)
        return real(*args)

    monkeypatch.setattr(rr22, "match", match)
    with pytest.raises(KilledError):  # buckets 0, 1, 2 matched, then the receiver stops
        _both(a, b, "rr22-resume", workspace)
    assert not PartyStore.of(a).has_table("accounts_aligned")
    monkeypatch.setattr(rr22, "match", real)
    ids = _both(a, b, "rr22-resume", workspace)
    assert ids[0] == ids[1] and set(ids[0]) == expected and len(ids[0]) == 300
    for ref in (a, b):  # the job's working tables are gone with the alignment
        with PartyStore.of(ref).connect() as con:
            query = "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE ?"
            assert con.execute(query, ["privreg_psi%"]).fetchone()[0] == 0


def test_a_small_set_meets_many_buckets_with_one_table(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, expected = make_parties(workspace, shared=100, only_a=20, only_b=900)
    monkeypatch.setattr(buckets, "BUCKET_IDS", 128)  # bank's 120 ids: one table; shop's 1000: 8
    ids = _both(a, b, "rr22-one-table", workspace)
    assert ids[0] == ids[1] and set(ids[0]) == expected
    sent = [(r.kind, r.round) for r in channel_for("rr22-one-table", str(workspace)).log()]
    assert [m for m in sent if m[0] == rr22.KIND_OKVS] == [(rr22.KIND_OKVS, 0)]
    assert sorted(n for kind, n in sent if kind == rr22.KIND_VALUES) == list(range(8))
