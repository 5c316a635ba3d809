"""Everyday operation of ``privreg``: a status that tells the truth (a silent party is down by
its peers' rule, ``--json``, ``--watch``), ended sides reaped, and commands that only look do
not load Prefect."""

from __future__ import annotations

import json
import os
import signal
import time
import types
from pathlib import Path

import pytest

from federation.channel import FileTransport
from federation.party_config import PartyConfig
from federation.standing_policy import StandingPolicy
from federation.status import DOWN_AFTER, PartyStatus, Proposal
from privreg import job_cli
from privreg.cli import main
from privreg.party_service import PartyService

PARTIES = ("ads", "arbiter", "bank")


def _publish(transport: FileTransport, party: str, state: str, heartbeat: float) -> None:
    record = PartyStatus(party, "credit", state, PARTIES, heartbeat=heartbeat, seq=1)
    transport.publish_status("credit", party, record.to_bytes())


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FileTransport:
    """The bank's view of job ``credit`` through a shared folder (no endpoint needed)."""
    transport = FileTransport(tmp_path / "runs")
    party = types.SimpleNamespace(party="bank", root=tmp_path)
    monkeypatch.setattr(job_cli, "_transport", lambda _config: (party, transport))
    return transport


def _status(capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    assert main(["job", "status", "credit", "--config", "party.toml", *extra]) == 0
    return capsys.readouterr().out


def test_a_party_silent_past_its_peers_down_time_is_shown_down(
    shared: FileTransport, capsys: pytest.CaptureFixture[str]
) -> None:
    now = time.time()
    _publish(shared, "bank", "running", now)
    _publish(shared, "ads", "running", now - DOWN_AFTER - 2)  # killed: its record went stale
    _publish(shared, "arbiter", "waiting", now - DOWN_AFTER + 10)  # slow, not yet down

    parties = {p["party"]: p for p in json.loads(_status(capsys, "--json"))["parties"]}
    assert parties["ads"]["down"] and parties["ads"]["down_since"] == pytest.approx(now - 32)
    assert parties["ads"]["state"] == "running"  # its last word, kept beside the verdict
    assert not parties["arbiter"]["down"] and not parties["bank"]["down"]
    assert set(parties) == set(PARTIES)

    lines = {line.split()[0]: line for line in _status(capsys).splitlines()[1:]}
    assert "down since " in lines["ads"] and "last: running" in lines["ads"]
    assert "down" not in lines["arbiter"] and "down" not in lines["bank"]


def test_an_ended_side_is_not_down_and_watch_ends_with_the_run(
    shared: FileTransport, capsys: pytest.CaptureFixture[str]
) -> None:
    old = time.time() - 10 * DOWN_AFTER
    for party, state in zip(PARTIES, ("done", "failed", "done"), strict=True):
        _publish(shared, party, state, old)
    started = time.monotonic()
    out = _status(capsys, "--watch", "--every", "60", "--json")
    assert time.monotonic() - started < 30  # no side is live: one look, not a minute's wait
    looks = out.strip().splitlines()
    assert len(looks) == 1
    assert not any(p["down"] for p in json.loads(looks[0])["parties"])


def _gone(pid: int, within: float = 20.0) -> bool:
    """Whether process ``pid`` ended and was reaped (no /proc entry, not even a zombie)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.1)
    return False


def test_sides_the_service_started_are_reaped_when_they_end(tmp_path: Path) -> None:
    """A side that fails on its own (here: an empty party.toml) and one killed with SIGKILL
    both leave no ``<defunct>`` process, with no further proposal to trigger a clean-up."""
    folder = tmp_path / "lab"
    (folder / "jobs").mkdir(parents=True)
    (folder / "jobs" / "demo.json").write_text('{"job": "demo"}')
    (folder / "party.toml").write_text("")
    conf = PartyConfig(
        party="lab", root=folder / "home", listen="", ca=Path(), cert=Path(), key=Path(),
        policy=StandingPolicy(accept_from=("clinic",)),
    )  # fmt: skip
    service = PartyService(conf, folder / "party.toml")
    try:
        service("clinic", Proposal("jobs/demo.json", "fails"))
        service("clinic", Proposal("jobs/demo.json", "killed"))
        sides = {run: side.pid for run, (_, side) in service._sides.items()}
        os.kill(sides["demo-killed"], signal.SIGKILL)
        for run, pid in sides.items():
            assert _gone(pid), f"{run}: process {pid} still there: " + Path(
                f"/proc/{pid}/status"
            ).read_text().splitlines()[1]
        assert not service._sides  # forgotten as well: the limits count live sides only
    finally:
        service.stop()
