"""The parties' check of the coordinator's sum, fed by the coordinator's relays: each party
unmasks the round itself from two messages, whatever the number of parties, and refuses a
relay in which one peer's masked input or answer was altered, swapped, replayed or dropped,
naming that peer. One process, the shared-folder transport (the network transport's proofs:
tests/test_network_channel.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.job_schema import HorizontalOptions
from core.secagg.errors import ProtocolViolationError
from federation.channel import Channel, FileTransport, PartyEndpoint
from federation.workspace import channel_for
from storage import codec
from storage.party_store import PartyStore
from tasks import secure_rounds
from tasks import secure_rounds_coordinator as rounds_coordinator
from tasks import secure_rounds_party as rounds_party
from tasks.horizontal_coordinator import Coordinator, _call_round
from tasks.secure_sum import COORDINATOR, collect, coordinator_store

OPTIONS = HorizontalOptions(learning_rate=0.2, stage_timeout=30.0)
Tamper = Callable[[int, dict[str, Any]], dict[str, Any]]


@dataclass
class Job:
    side: Coordinator
    stores: dict[str, PartyStore]
    vectors: dict[str, np.ndarray]
    ends: dict[str, PartyEndpoint]

    @property
    def job(self) -> secure_rounds.RoundsJob:
        return self.side.job

    @property
    def parties(self) -> tuple[str, ...]:
        return self.side.parties


def start_job(tmp_path: Path, n: int, job_id: str = "relay-job") -> Job:
    """``n`` hospitals with their keys admitted; 2 features, so 5 numbers a party."""
    parties = tuple(f"hospital_{i}" for i in range(n))
    channel = channel_for(job_id, str(tmp_path))
    ends = {p: channel.endpoint(p) for p in (*parties, COORDINATOR)}
    side = Coordinator(
        ends[COORDINATOR], coordinator_store(str(tmp_path)), parties, n // 2 + 1, OPTIONS, 2
    )
    stores = {p: PartyStore(tmp_path / f"{p}.duckdb") for p in parties}
    stores[COORDINATOR] = side.store
    for party in parties:
        rounds_party.party_join(stores[party], side.job, ends[party], 0)
    keys = collect(ends[COORDINATOR], secure_rounds.JOB_KEYS, list(parties), 0, 5.0)
    rounds_coordinator.coordinator_admit(stores[COORDINATOR], side.job, keys)
    vectors = {p: np.arange(5.0) * (i + 1) for i, p in enumerate(parties)}
    return Job(side, stores, vectors, ends)


def run_round(setup: Job, round_: int) -> dict[str, np.ndarray | None]:
    """One round as the horizontal flow runs it; each party's own unmasking of the sum."""
    job, stores, ends = setup.job, setup.stores, setup.ends
    call = _call_round(setup.side, round_)
    records = {}
    for party in setup.parties:
        start = rounds_party.round_start(job, round_, call.protocol, party)
        vector = setup.vectors[party] + round_
        rounds_party.party_mask(stores[party], job, ends[party], start, vector)
    coordinator = ends[COORDINATOR]
    masked = collect(coordinator, secure_rounds.MASKED, list(setup.parties), round_, 5.0)
    senders, _ = rounds_coordinator.coordinator_collect(
        stores[COORDINATOR], job, coordinator, round_, masked, views=False
    )
    requests = {}
    for party in senders:  # the consistency round: each signs its view, all are relayed
        requests[party] = ends[party].receive(COORDINATOR, secure_rounds.REQUEST, round=round_)
        rounds_party.party_view(stores[party], job, ends[party], round_, requests[party])
    rounds_coordinator.coordinator_relay_views(stores[COORDINATOR], job, coordinator, round_)
    for party in senders:
        records[party] = rounds_party.party_answer(
            stores[party], job, ends[party], round_, requests[party]
        )
    answers = collect(coordinator, secure_rounds.RESPONSE, senders, round_, time.monotonic() + 5)
    with stores[COORDINATOR].transaction() as con:
        summed = rounds_coordinator.coordinator_unmask(
            stores[COORDINATOR], job, round_, answers, con
        )
    rounds_coordinator.coordinator_relay_answers(coordinator, round_, senders, summed.responders)
    expected = sum(setup.vectors[p] + round_ for p in senders)
    np.testing.assert_allclose(summed.total, expected)
    return {
        party: rounds_party.party_sum(
            job, ends[party], records[party], call.protocol, round_, summed.responders, 5.0
        )
        for party in senders
    }


def tamper_relays(monkeypatch: pytest.MonkeyPatch, kind: str, change: Tamper) -> None:
    """A malicious coordinator: every ``kind`` relay it sends is ``change(round, entries)``."""
    real_write = Channel._write_each

    def write(self: Channel, r: int, sender: str, k: str, payloads: dict[str, Any]) -> Any:
        if sender == COORDINATOR and k == kind:
            payloads = {receiver: change(r, dict(p)) for receiver, p in payloads.items()}
        return real_write(self, r, sender, k, payloads)

    monkeypatch.setattr(Channel, "_write_each", write)


def altered(entry: dict[str, Any], edit: Callable[[Any], Any]) -> dict[str, Any]:
    """The entry with its message decoded, edited and encoded again (a coordinator's forgery
    as good as it can make one: well formed, only the content changed)."""
    return {**entry, "data": codec.dumps(edit(codec.loads(entry["data"])))}


def test_each_party_checks_the_sum_from_two_relays_whatever_the_number_of_parties(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five parties: each sends its masked input, its signed view and its answer once (to the
    coordinator), and reads the peers' from the coordinator's relays, not 3 (n - 1) copies."""
    setup = start_job(tmp_path, 5)
    reads: list[tuple[str, str, str]] = []
    real_get = FileTransport.get

    def get(self: FileTransport, key: Any, timeout: float) -> bytes:
        reads.append((key.receiver, key.sender, key.kind))
        return real_get(self, key, timeout)

    monkeypatch.setattr(FileTransport, "get", get)
    sums = run_round(setup, 0)
    expected = sum(setup.vectors.values())
    for party, own in sums.items():
        np.testing.assert_allclose(own, expected)
        # its reads in the round, all from the coordinator: its request, the relay of the
        # signed views (read, then checked entry by entry) and the two relays of its check
        mine = {(sender, kind) for receiver, sender, kind in reads if receiver == party}
        relays = [secure_rounds.MASKED_RELAY, secure_rounds.RESPONSE_RELAY]
        kinds = [secure_rounds.REQUEST, secure_rounds.VIEW_RELAY, *relays]
        assert mine == {(COORDINATOR, kind) for kind in kinds}
    log = setup.ends[COORDINATOR].channel.log()
    for party in setup.parties:
        sent = [(r.receiver, r.kind) for r in log if r.sender == party and r.round == 0]
        kinds = [secure_rounds.JOB_KEYS, secure_rounds.MASKED, secure_rounds.RESPONSE]
        kinds = sorted([*kinds, secure_rounds.VIEW])
        assert sorted(sent) == [(COORDINATOR, kind) for kind in kinds]


def _bump(masked: dict[str, Any]) -> dict[str, Any]:
    """A masked input moved by one unit in its first number."""
    moved = np.array(masked["masked"], copy=True)
    moved[0] += 1
    return {**masked, "masked": moved}


FORGERIES: dict[str, tuple[str, Tamper]] = {
    "altered input": (
        secure_rounds.MASKED_RELAY,
        lambda r, e: {**e, "hospital_1": altered(e["hospital_1"], _bump)},
    ),
    # hospital_1's answer given as hospital_2's
    "swapped answer": (
        secure_rounds.RESPONSE_RELAY,
        lambda r, e: {**e, "hospital_1": e["hospital_2"]},
    ),
    # hospital_1 left out of the relay of the inputs
    "dropped input": (
        secure_rounds.MASKED_RELAY,
        lambda r, e: {p: v for p, v in e.items() if p != "hospital_1"},
    ),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_relay_with_one_peers_message_forged_is_refused_naming_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forgery: str
) -> None:
    kind, change = FORGERIES[forgery]
    setup = start_job(tmp_path, 3)
    tamper_relays(monkeypatch, kind, change)
    with pytest.raises(ProtocolViolationError, match="from hospital_1 to coordinator") as refused:
        run_round(setup, 0)
    assert "refusing the coordinator's sum of round 0" in str(refused.value)


def test_a_replayed_message_of_an_earlier_round_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 1's relay carries hospital_1's answer of round 0 (a message it did send, and a
    true one): it is not what hospital_1 sent in round 1."""
    setup = start_job(tmp_path, 3)
    first: dict[str, Any] = {}

    def replay(r: int, entries: dict[str, Any]) -> dict[str, Any]:
        first.setdefault(r, entries)
        return entries if r == 0 else {**entries, "hospital_1": first[0]["hospital_1"]}

    tamper_relays(monkeypatch, secure_rounds.RESPONSE_RELAY, replay)
    assert all(own is not None for own in run_round(setup, 0).values())
    with pytest.raises(ProtocolViolationError, match="from hospital_1 to coordinator in round 1"):
        run_round(setup, 1)
