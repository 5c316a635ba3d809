"""``psi_align`` with KKRT16 (the default) under Prefect: one process, many buckets and a resume
after a failure mid-way, and two party processes over mutual TLS (RR22 too); refusals (replayed,
truncated, duplicates, too small) leave no aligned table behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers import party_env
from prefect import flow
from prefect.exceptions import ParameterTypeError
from test_party_processes import PARTIES, make_tables, write_config
from test_psi_flow import make_parties

from core import psi
from core.psi_ot import buckets
from core.psi_ot import protocol as kkrt
from demo.orgs import free_port
from federation.channel import Channel, ChannelError, MessageConflictError
from federation.workspace import channel_for
from flows.align import psi_align
from privreg.cli import main as privreg
from storage import codec, party_store
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import psi_kkrt
from tasks.psi import PsiSide

pytestmark = pytest.mark.usefixtures("prefect_server")


def _ids(ref: TableRef, result: dict, index: int) -> list[str]:
    aligned = TableRef.from_dict(result["aligned"][index])
    return PartyStore.of(ref).read_table(aligned)["id"].tolist()


def test_kkrt_flow_aligns_like_ecdh_and_leaks_no_id(workspace: Path) -> None:
    a, b, expected = make_parties(workspace)
    result = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="kkrt")
    assert result["intersection_size"] == len(expected) == 150
    assert result["set_sizes"] == [190, 210]
    kkrt_a, kkrt_b = _ids(a, result, 0), _ids(b, result, 1)
    assert kkrt_a == kkrt_b and set(kkrt_a) == expected  # one order on both sides
    # no secret of the finished job stays in this process's memory: job keys, base-OT seeds
    assert not [k for k in psi_kkrt.JOB_KEYS if k[1] == result["job_id"]]
    assert kkrt._base_ot_pairs.cache_info().currsize == 0
    assert kkrt._base_ot_chosen.cache_info().currsize == 0

    channel = channel_for(result["job_id"], str(workspace))
    records = channel.log()
    assert sorted((r.sender, r.kind, r.round) for r in records) == [
        ("bank", kkrt.KIND_HELLO, 0),
        ("bank", kkrt.KIND_MATRIX, 0),
        ("bank", kkrt.KIND_POSITIONS, 0),
        ("bank", kkrt.KIND_RESULT, 0),
        ("bank", kkrt.KIND_SIZE, 0),
        ("shop", kkrt.KIND_REPLY, 0),
        ("shop", kkrt.KIND_SIZE, 0),
        ("shop", kkrt.KIND_VALUES, 0),
    ]  # bank has the smaller set (190 < 210): it is the OPRF receiver
    raw = b"".join(channel.read_raw(r) for r in records)
    everyone = set(PartyStore.of(a).read_table(a)["id"]) | set(PartyStore.of(b).read_table(b)["id"])
    assert not any(i.encode() in raw for i in everyone)
    digests = kkrt.item_digests(sorted(everyone), "test")
    assert not any(d[:15].tobytes() in raw for d in digests)

    again = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="kkrt")
    assert again["reused"] and again["job_id"] == result["job_id"]
    ecdh = psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="ecdh")
    assert ecdh["job_id"] != result["job_id"]  # one job per protocol
    assert set(_ids(a, ecdh, 0)) == set(kkrt_a) and _ids(a, ecdh, 0) == _ids(b, ecdh, 1)


def test_small_intersection_is_refused_and_nothing_written(workspace: Path) -> None:
    a, b, _ = make_parties(workspace, shared=30)
    with pytest.raises(psi.PsiError, match="below min_rows=100"):
        psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="kkrt")
    assert not PartyStore.of(a).has_table("accounts_aligned")
    assert not PartyStore.of(b).has_table("orders_aligned")


def test_unknown_protocol_is_refused(workspace: Path) -> None:
    a, b, _ = make_parties(workspace)
    expected = "protocol: Input should be 'kkrt', 'rr22' or 'ecdh'"
    with pytest.raises(ParameterTypeError, match=expected):
        psi_align(a.to_dict(), b.to_dict(), workspace=str(workspace), protocol="spot")


def _both(a: dict, b: dict, job: str, workspace: str) -> list[dict]:
    """Both sides of a KKRT job with a given id, in this process; each side's aligned table."""
    aligned = psi_align(a, b, workspace=workspace, job_id=job, protocol="kkrt")["aligned"]
    return [{"table": side["table"]} for side in aligned]


def _nothing_aligned(a: TableRef, b: TableRef) -> None:
    assert not PartyStore.of(a).has_table("accounts_aligned")
    assert not PartyStore.of(b).has_table("orders_aligned")


def test_replayed_message_with_other_payload_is_refused(workspace: Path) -> None:
    a, b, _ = make_parties(workspace)
    endpoint = channel_for("kkrt-replay", str(workspace)).endpoint("bank")
    endpoint.send("shop", kkrt.KIND_MATRIX, {"u": b"forged", "hash_key": b"", "bins": 1})
    # both sides run at once: the receiver's own matrix is refused (a message is never
    # replaced), or the sender refuses the forged one first; either way nothing is aligned
    with pytest.raises(
        (MessageConflictError, psi.PsiError),
        match=r"different payload for the 'psi_kkrt_matrix'|matrix message from bank .* bins",
    ):
        _both(a.to_dict(), b.to_dict(), "kkrt-replay", str(workspace))
    _nothing_aligned(a, b)


@flow
def _shop_reply(b: dict, job: str, workspace: str) -> None:
    ref = TableRef.from_dict(b)
    psi_kkrt.send_reply(PsiSide(ref, "bank", Channel(workspace, job).endpoint(ref.party)))


def test_truncated_messages_are_refused(workspace: Path) -> None:
    a, b, _ = make_parties(workspace)
    channel = channel_for("kkrt-cut", str(workspace))
    key = channel.key(0, "bank", "shop", kkrt.KIND_HELLO)
    path = channel.transport.store().path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(codec.dumps(kkrt.hello(kkrt.new_party_key()))[:-7])  # cut on the wire
    with pytest.raises(ChannelError, match="refused the 'psi_kkrt_hello' message from bank"):
        _shop_reply(b.to_dict(), "kkrt-cut", str(workspace))
    assert channel.endpoint("shop").sent("bank", kkrt.KIND_REPLY) is None  # nothing answered

    channel = channel_for("kkrt-short", str(workspace))
    hello = kkrt.hello(kkrt.new_party_key())
    channel.endpoint("bank").send("shop", kkrt.KIND_HELLO, {**hello, "base_ot": b"\x04" * 65})
    with pytest.raises(psi.PsiError, match="hello message from bank is malformed: base_ot"):
        _shop_reply(b.to_dict(), "kkrt-short", str(workspace))
    assert channel.endpoint("shop").sent("bank", kkrt.KIND_REPLY) is None
    _nothing_aligned(a, b)


class KilledError(ValueError):
    """The party's process ending mid-way (a ValueError: the step is not retried)."""


def test_many_buckets_and_a_resume_that_skips_finished_buckets(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, expected = make_parties(workspace, shared=300, only_a=100, only_b=200)
    monkeypatch.setattr(buckets, "BUCKET_IDS", 64)  # 500 ids at the larger side: 8 buckets
    calls: dict[str, list[int]] = {"matrix": [], "values": [], "match": []}
    steps = {"matrix": "extend", "values": "evaluate", "match": "match"}  # their functions
    real = {name: getattr(kkrt, steps[name]) for name in calls}

    def counted(name: str, fail_at: int | None):
        def step(*args):
            if name != "match":
                calls[name].append(args[4] if name == "matrix" else args[5])
            elif len(calls["match"]) == fail_at:
                raise KilledError("killed while matching")
            else:
                calls["match"].append(len(calls["match"]))
            return real[name](*args)

        return step

    for name in calls:
        monkeypatch.setattr(kkrt, steps[name], counted(name, 3))
    with pytest.raises(KilledError):  # buckets 0, 1, 2 matched, then the receiver stops
        _both(a.to_dict(), b.to_dict(), "kkrt-resume", str(workspace))
    _nothing_aligned(a, b)
    # the receiver sends the next matrix before each match; the sender answers each matrix
    assert calls["matrix"] == [0, 1, 2, 3, 4] and calls["match"] == [0, 1, 2]
    first_values = list(calls["values"])
    assert first_values in ([0, 1, 2, 3], [0, 1, 2, 3, 4])  # 4: if it answered before it heard
    for name in calls:
        calls[name].clear()
        monkeypatch.setattr(kkrt, steps[name], counted(name, None))
    results = _both(a.to_dict(), b.to_dict(), "kkrt-resume", str(workspace))
    assert calls["matrix"] == [3, 4, 5, 6, 7]  # the unmatched buckets' matrices again
    assert calls["values"] == [b for b in range(8) if b not in first_values]  # none redone
    assert len(calls["match"]) == 5
    ids_a = PartyStore.of(a).read_table(a.with_table(results[0]["table"]))["id"].tolist()
    ids_b = PartyStore.of(b).read_table(b.with_table(results[1]["table"]))["id"].tolist()
    assert ids_a == ids_b and set(ids_a) == expected and len(ids_a) == 300
    for ref in (a, b):  # the job's working tables and secrets are gone with the alignment
        with PartyStore.of(ref).connect() as con:
            query = "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE ?"
            left = con.execute(query, ["privreg_psi%"]).fetchone()[0]
        assert left == 0


def test_a_small_set_meets_many_buckets_with_one_matrix(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, expected = make_parties(workspace, shared=100, only_a=20, only_b=900)
    monkeypatch.setattr(buckets, "BUCKET_IDS", 128)  # bank's 120 ids: one table; shop's 1000: 8
    results = _both(a.to_dict(), b.to_dict(), "kkrt-one-table", str(workspace))
    ids = [
        PartyStore.of(ref).read_table(ref.with_table(result["table"]))["id"].tolist()
        for ref, result in zip((a, b), results, strict=True)
    ]
    assert ids[0] == ids[1] and set(ids[0]) == expected
    sent = [(r.kind, r.round) for r in channel_for("kkrt-one-table", str(workspace)).log()]
    assert [m for m in sent if m[0] == kkrt.KIND_MATRIX] == [(kkrt.KIND_MATRIX, 0)]
    assert sorted(n for kind, n in sent if kind == kkrt.KIND_VALUES) == list(range(8))


def test_duplicate_ids_are_refused_before_their_party_sends_anything(workspace: Path) -> None:
    a, b, _ = make_parties(workspace)
    store = PartyStore.of(b)
    with store.connect() as con:
        frame = con.execute('SELECT * FROM "orders" ORDER BY rowid').df()
    frame.loc[7, "id"] = " " + frame.loc[2, "id"]  # the same id once white space is stripped
    store.write_table("orders", frame)  # as a table written around the importer's checks
    with pytest.raises(psi.PsiError, match=r"shop \(orders.id\): id at row 8 duplicates row 3"):
        _both(a.to_dict(), b.to_dict(), "kkrt-dup", str(workspace))  # the flow's own check aside
    _nothing_aligned(a, b)
    with store.connect() as con:
        tables = con.execute("SELECT table_name FROM information_schema.tables").fetchall()
    assert not any(name.startswith("privreg_psi") for (name,) in tables)
    # the party with the repeat sent nothing (its peer checks its own ids, then sends its size)
    assert not list(workspace.glob("runs/*/messages/*/shop__*"))


def test_a_table_read_in_one_piece_skips_the_second_duplicate_pass(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids read in one piece have all met in memory (the test above: a repeat is refused
    there), so the pass over the stored digests runs only for tables of several pieces."""
    a, _, _ = make_parties(workspace)
    passes: list[tuple] = []
    monkeypatch.setattr(psi_kkrt, "_repeat_in", lambda *args: passes.append(args))
    size = psi_kkrt.prepare_ids.fn(a, "kkrt-one-piece")
    assert size == len(PartyStore.of(a).read_table(a)) and passes == []


def test_steps_over_the_whole_digest_table_hold_one_slice(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory follows the slice, not the table: the ids are stored piece by piece, and the
    duplicate check and the rewrite in bucket order each see one slice of rows at a time;
    together the slices cover every row once, and a duplicate two pieces apart is found."""
    a, b, expected = make_parties(workspace, shared=300, only_a=100, only_b=200)
    monkeypatch.setattr(party_store, "CHUNK_ROWS", 50)
    monkeypatch.setattr(psi_kkrt, "SLICE_ROWS", 64)
    monkeypatch.setattr(buckets, "BUCKET_IDS", 64)  # 8 buckets
    seen: dict[str, list[int]] = {"check": [], "rewrite": []}
    check, rewrite = psi_kkrt._repeat_in, psi_kkrt._insert_buckets

    def counted_check(con, table, low, high):
        where = psi_kkrt._in_slice(low, high)
        seen["check"].append(
            con.execute(f'SELECT count(*) FROM "{table}" WHERE {where}').fetchone()[0]
        )
        return check(con, table, low, high)

    def counted_rewrite(con, table, ordered, count, group):
        before = con.execute(f'SELECT count(*) FROM "{ordered}"').fetchone()[0]
        rewrite(con, table, ordered, count, group)
        seen["rewrite"].append(
            con.execute(f'SELECT count(*) FROM "{ordered}"').fetchone()[0] - before
        )

    monkeypatch.setattr(psi_kkrt, "_repeat_in", counted_check)
    monkeypatch.setattr(psi_kkrt, "_insert_buckets", counted_rewrite)
    results = _both(a.to_dict(), b.to_dict(), "kkrt-slices", str(workspace))
    ids = [
        PartyStore.of(ref).read_table(ref.with_table(result["table"]))["id"].tolist()
        for ref, result in zip((a, b), results, strict=True)
    ]
    assert ids[0] == ids[1] and set(ids[0]) == expected
    for step, rows in seen.items():  # both parties' slices: 400 + 500 rows
        assert sum(rows) == 900 and len(rows) >= 900 // 64, step
        assert max(rows) <= 2 * 64, (step, rows)  # a slice, not the table (mean 56-64)

    store = PartyStore.of(b)
    with store.connect() as con:
        frame = con.execute('SELECT * FROM "orders" ORDER BY rowid').df()
    frame.loc[300, "id"] = frame.loc[7, "id"]  # pieces 0 and 6 of 50 rows
    store.write_table("orders", frame)
    with pytest.raises(psi.PsiError, match=r"shop \(orders.id\): id at row 301 duplicates row 8"):
        _both(a.to_dict(), b.to_dict(), "kkrt-slices-dup", str(workspace))
    with store.connect() as con:
        tables = con.execute("SELECT table_name FROM information_schema.tables").fetchall()
    assert not any(name.startswith("privreg_psi") for (name,) in tables)  # digests dropped


_DRIVER = """
import json, os, sys
from federation.party_config import ENV_VAR, PartyConfig
os.environ[ENV_VAR] = os.path.abspath(sys.argv[1])
own = PartyConfig.load(sys.argv[1]).own_table(json.loads(sys.argv[2]))
from core.job_schema import PsiOptions
from flows.align import psi_align_party
protocol = sys.argv[4]
options = PsiOptions(protocol=protocol)
print(json.dumps(psi_align_party(own, sys.argv[3], f"{protocol}-two", options)))
"""


@pytest.mark.parametrize("protocol", ["kkrt", "rr22"])
def test_two_party_processes_over_mtls(tmp_path: Path, protocol: str) -> None:
    bank, shop, expected = make_tables(tmp_path)
    certs = tmp_path / "ca-admin"
    assert privreg(["certs", "init", "--out", str(certs)]) == 0
    for party in PARTIES:
        assert (
            privreg(["certs", "issue", "--ca", str(certs), "--party", party, "--out", str(certs)])
            == 0
        )
    ports = {party: free_port() for party in PARTIES}
    configs = {party: write_config(tmp_path, party, ports, certs) for party in PARTIES}
    serve = [sys.executable, "-m", "privreg.cli", "party", "serve", "--config"]
    servers = [
        subprocess.Popen(
            [*serve, str(configs[p])],
            cwd=tmp_path / p,
            env=party_env(tmp_path / p),
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in PARTIES
    ]
    runs: list[subprocess.Popen] = []
    try:
        for server in servers:
            assert "serving its messages" in server.stdout.readline()
        refs = {"bank": bank, "shop": shop}
        runs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _DRIVER,
                    str(configs[party]),
                    json.dumps(refs[party].to_dict()),
                    peer,
                    protocol,
                ],
                cwd=tmp_path / party,
                env=party_env(tmp_path / party),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for party, peer in (("bank", "shop"), ("shop", "bank"))
        ]
        deadline = time.monotonic() + 180
        outputs = [run.communicate(timeout=max(deadline - time.monotonic(), 1)) for run in runs]
    finally:
        for process in [*runs, *servers]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [r["intersection_size"] for r in results] == [len(expected)] * 2 == [140] * 2
    bank_ids = PartyStore.of(bank).read_table(bank.with_table("accounts_aligned"))["id"]
    shop_ids = PartyStore.of(shop).read_table(shop.with_table("orders_aligned"))["id"]
    assert bank_ids.tolist() == shop_ids.tolist() and set(bank_ids) == expected
    assert isinstance(bank_ids, pd.Series)
