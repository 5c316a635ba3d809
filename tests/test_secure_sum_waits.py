"""Waiting for the parties' messages: no wait past the last arrival, the missing named while
it lasts, and a dropped hospital's way back in (left out, asks to rejoin, called again)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from storage.workspace import channel_for
from tasks import horizontal_lr as steps
from tasks.secure_sum import COORDINATOR, collect


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


def test_a_left_out_hospital_asks_to_rejoin_and_the_coordinator_sees_it(tmp_path: Path) -> None:
    job, parties = "rejoin-job", ("hospital_a", "hospital_b", "hospital_c")
    options = steps.TrainingOptions(0, 0.2, 1e-3)
    call = steps.RoundCall("session-5", parties, 2, 30.0, options, ("hospital_b",))
    assert steps.RoundCall.from_message(call.to_message()) == call
    assert steps.RoundCall.from_message({**call.to_message(), "out": []}).out == ()
    coordinator = channel_for(job, str(tmp_path)).endpoint(COORDINATOR)
    for party in parties:
        coordinator.send(party, "round", call.to_message(), round=5)
    ctx = steps.round_context(job, 5, "session-5", parties, 2, 4, str(tmp_path), 30.0)
    refs = {p: steps.TableRef(database=str(tmp_path / f"{p}.duckdb"), table="t") for p in parties}
    assert [steps.left_out(refs[p], ctx) for p in parties] == [False, True, False]
    assert steps.rejoin_requests(job, 5, ["hospital_b"], str(tmp_path)) == []
    steps.ask_to_rejoin(refs["hospital_b"], ctx)
    assert steps.rejoin_requests(job, 5, ["hospital_b"], str(tmp_path)) == ["hospital_b"]
    assert steps.rejoin_requests(job, 4, ["hospital_b"], str(tmp_path)) == []  # that round only
