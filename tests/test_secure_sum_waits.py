"""Waiting for the parties' messages: no wait past the last arrival, the missing named while
it lasts, and a dropped hospital's way back in (left out, re-keys, asks to rejoin, called
again)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from core.job_schema import HorizontalOptions
from federation.workspace import channel_for
from storage.party_store import PartyStore
from tasks import secure_rounds
from tasks import secure_rounds_coordinator as rounds_coordinator
from tasks import secure_rounds_party as rounds_party
from tasks.horizontal_coordinator import Coordinator, _call_round
from tasks.horizontal_lr import RoundCall
from tasks.secure_sum import COORDINATOR, collect, coordinator_store


def test_collect_returns_when_the_last_message_arrives_and_names_who_is_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    channel = channel_for("wait-job", str(tmp_path))
    channel.endpoint("hospital_a").send(COORDINATOR, "schema", {"n": 1})
    late = threading.Timer(
        1.0, lambda: channel.endpoint("hospital_b").send(COORDINATOR, "schema", {"n": 2})
    )
    late.start()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="tasks.secure_sum"):
        found = collect(
            channel.endpoint(COORDINATOR),
            "schema",
            ["hospital_a", "hospital_b"],
            0,
            started + 120,
            report_every=0.3,
        )
    late.join()
    assert found == {"hospital_a": {"n": 1}, "hospital_b": {"n": 2}}
    assert time.monotonic() - started < 60  # returned on arrival, not at the deadline
    waiting = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert waiting and all("from hospital_b, since" in line for line in waiting)


def test_a_party_that_never_sends_is_named_until_the_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    channel = channel_for("silent-job", str(tmp_path))
    channel.endpoint("hospital_a").send(COORDINATOR, "schema", {"n": 1})
    with caplog.at_level(logging.INFO, logger="tasks.secure_sum"):
        found = collect(
            channel.endpoint(COORDINATOR),
            "schema",
            ["hospital_a", "hospital_c"],
            0,
            time.monotonic() + 1.5,
            report_every=0.4,
        )
    assert found == {"hospital_a": {"n": 1}}
    waiting = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(waiting) >= 2 and all("from hospital_c" in line for line in waiting)


def test_a_dropped_hospital_rekeys_asks_to_rejoin_and_is_called_again(tmp_path: Path) -> None:
    """Keys once per job; a round with hospital_b silent sums the other two exactly; the
    following calls leave b out until it re-keys (a higher epoch, once) and asks back."""
    parties = ("hospital_a", "hospital_b", "hospital_c")
    channel = channel_for("rejoin-job", str(tmp_path))
    ends = {p: channel.endpoint(p) for p in (*parties, COORDINATOR)}
    coordinator = ends[COORDINATOR]
    side = Coordinator(
        coordinator, coordinator_store(str(tmp_path)), parties, 2,
        HorizontalOptions(learning_rate=0.2, stage_timeout=30.0), width=2,
    )  # fmt: skip
    job = side.job  # 5 numbers a party
    stores = {p: PartyStore(tmp_path / f"{p}.duckdb") for p in parties}
    stores[COORDINATOR] = side.store
    for party in parties:
        rounds_party.party_join(stores[party], job, ends[party], 0)
    keys = collect(coordinator, secure_rounds.JOB_KEYS, list(parties), 0, time.monotonic() + 5)
    rounds_coordinator.coordinator_admit(stores[COORDINATOR], job, keys)

    call = _call_round(side, 0)
    assert call.out == () and call.protocol is not None
    assert RoundCall.from_message(call.to_message()) == call
    vectors = {p: np.arange(5.0) * (i + 1) for i, p in enumerate(parties)}
    for party in ("hospital_a", "hospital_c"):  # b stays silent
        start = rounds_party.round_start(job, 0, call.protocol, party)
        rounds_party.party_mask(stores[party], job, ends[party], start, vectors[party])
    masked = collect(coordinator, secure_rounds.MASKED, list(parties), 0, time.monotonic() + 0.2)
    senders, dropped = rounds_coordinator.coordinator_collect(
        stores[COORDINATOR], job, coordinator, 0, masked, views=False
    )
    assert (senders, dropped) == (["hospital_a", "hospital_c"], ["hospital_b"])
    requests = {}
    for party in senders:  # each signs its view of the survivor set, then all are relayed
        requests[party] = ends[party].receive(COORDINATOR, secure_rounds.REQUEST, round=0)
        rounds_party.party_view(stores[party], job, ends[party], 0, requests[party])
    rounds_coordinator.coordinator_relay_views(stores[COORDINATOR], job, coordinator, 0)
    for party in senders:
        rounds_party.party_answer(stores[party], job, ends[party], 0, requests[party])
    answers = collect(coordinator, secure_rounds.RESPONSE, senders, 0, time.monotonic() + 5)
    with stores[COORDINATOR].transaction() as con:
        summed = rounds_coordinator.coordinator_unmask(stores[COORDINATOR], job, 0, answers, con)
        secure_rounds.save_record(stores[COORDINATOR], job, COORDINATOR, summed.record, con)
    np.testing.assert_allclose(summed.total, vectors["hospital_a"] + vectors["hospital_c"])

    # dropped stays dropped: round 1 leaves b out; b re-keys once, asking back each call
    first = _call_round(side, 1)
    assert first.out == ("hospital_b",) and "hospital_b" not in first.protocol["keys"]
    rounds_party.party_rejoin(stores["hospital_b"], job, ends["hospital_b"], 1)
    rounds_party.party_rejoin(stores["hospital_b"], job, ends["hospital_b"], 1)  # same keys
    back = coordinator.receive("hospital_b", secure_rounds.REJOIN, round=1)
    assert back["keys"][0] == 1  # epoch 1: fresh keys, the old ones gone
    second = _call_round(side, 2)
    assert second.out == () and second.protocol["keys"]["hospital_b"] == back["keys"]
