"""The channel records what crossed; the ledger charges each release exactly once."""

from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from core.dp.accounting import ApproximateDP, Charge, composed_epsilon
from federation.channel import Channel, ChannelError
from storage import codec
from storage.artifacts import ArtifactStore
from storage.ledger import BudgetError, PrivacyLedger
from storage.party_store import PartyStore


def test_codec_round_trips_without_pickle() -> None:
    value = {
        "ct": [2**2048 + 3, 5, -(2**80)],
        "w": np.linspace(-1, 1, 7),
        "raw": b"\x00\x01",
        "n": 3,
        "nested": [{"f": 0.5}],
        "big": 2**64,
    }
    back = codec.loads(codec.dumps(value))
    assert back["ct"] == value["ct"] and back["big"] == 2**64 and back["raw"] == b"\x00\x01"
    assert np.array_equal(back["w"], value["w"]) and back["nested"] == [{"f": 0.5}]
    with pytest.raises(codec.CodecError):
        codec.dumps({"f": object()})
    with pytest.raises(codec.CodecError):
        codec.dumps(np.array([1, "a"], dtype=object))


def test_channel_records_and_enforces_addressing(tmp_path: Path) -> None:
    channel = Channel(tmp_path, "job-1")
    guest, host, arbiter = (channel.endpoint(p) for p in ("guest", "host", "arbiter"))
    record = host.send("guest", "wx", np.arange(4.0), round=3)
    assert guest.receive("host", "wx", round=3).tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ChannelError):
        arbiter.receive("host", "wx", round=3)  # addressed to the guest, not the arbiter
    with pytest.raises(ChannelError):
        guest.send("guest", "self", 1)
    log = channel.log()
    assert [(r.round, r.sender, r.receiver, r.kind) for r in log] == [(3, "host", "guest", "wx")]
    assert log[0].size == record.size == len(channel.read_raw(log[0]))
    assert channel.bytes_by_party() == {
        "host": {"sent": record.size, "received": 0},
        "guest": {"sent": 0, "received": record.size},
    }


def test_resend_is_idempotent_and_a_different_payload_is_refused(tmp_path: Path) -> None:
    channel = Channel(tmp_path, "job-2")
    a, b = channel.endpoint("a"), channel.endpoint("b")
    a.send("b", "x", 1)
    a.send("b", "x", 1)  # a retried step re-sending the same bytes: no-op
    with pytest.raises(ChannelError, match=r"different payload.*'x' message from a to b"):
        a.send("b", "x", 2)
    assert b.receive("a", "x") == 1
    assert a.sent("b", "x") == 1
    # a retried randomised step keeps what it sent and computes nothing new
    first = a.send_once("b", "ct", lambda: [secrets.randbits(64)], round=1)
    again = a.send_once("b", "ct", lambda: pytest.fail("must not recompute"), round=1)
    assert first == again and b.receive("a", "ct", round=1) == a.sent("b", "ct", round=1)
    assert [r.kind for r in channel.log()] == ["x", "ct"]
    assert not list(channel.folder.rglob(".tmp-*"))


def test_artifacts_are_private_to_the_party_database(tmp_path: Path) -> None:
    mine, theirs = (
        ArtifactStore(PartyStore(tmp_path / "a.duckdb")),
        ArtifactStore(PartyStore(tmp_path / "b.duckdb")),
    )
    mine.put("keys/paillier", {"p": 2**1024 + 7}, "secret")
    assert mine.get("keys/paillier") == {"p": 2**1024 + 7}
    assert theirs.get("keys/paillier") is None
    assert [k for k, *_ in mine.list("keys/")] == ["keys/paillier"]


def test_ledger_charges_once_and_refuses_overspend(tmp_path: Path) -> None:
    store = PartyStore(tmp_path / "labels.duckdb")
    ledger = PrivacyLedger(store)
    with pytest.raises(BudgetError, match="no privacy budget"):
        ledger.require_affordable("labels", 1.0, 1e-6)
    store.write_table("labels", pd.DataFrame({"id": [1]}))  # a budget needs the table
    ledger.set_budget("labels", epsilon=2.0, delta=1e-5)
    first = ledger.charge_and_store("rel-a", "labels", 1.5, 1e-6, "gaussian", "job", [1.0, 2.0])
    again = ledger.charge_and_store("rel-a", "labels", 1.5, 1e-6, "gaussian", "job", [9.0])
    assert first == again == [1.0, 2.0]  # a retry reuses the stored release
    status = ledger.status("labels")
    first_charge = Charge(ApproximateDP(1.5, 1e-6), 1.5, 1e-6)  # no event given: its pair
    assert status.epsilon_spent == composed_epsilon([first_charge], 1e-5) <= 1.5
    assert status.delta_total == 1e-5  # the owner's delta, at which the spend is read
    with pytest.raises(BudgetError, match="exceeds the budget"):
        ledger.charge_and_store("rel-b", "labels", 0.6, 0.0, "gaussian", "job", [3.0])
    assert ledger.stored_release("rel-b") is None
    assert len(ledger.spends("labels")) == 1
    ledger.charge_and_store("rel-c", "labels", 0.5, 0.0, "gaussian", "job", [3.0])
    both = [first_charge, Charge(ApproximateDP(0.5, 0.0), 0.5, 0.0)]
    assert ledger.status("labels").epsilon_left == pytest.approx(2.0 - composed_epsilon(both, 1e-5))
    assert ledger.status("labels").epsilon_left == pytest.approx(0.0, abs=1e-4)
