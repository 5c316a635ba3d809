"""Everyday operation of ``privreg``: a status that tells the truth (a silent party is down by
its peers' rule, ``--json``, ``--watch``), ended sides reaped, commands that only look do not
load Prefect, a bad Prefect database is one line and the log's path, and a mistyped command
gets a suggestion. (Start-up times are measured by ``benchmarks/bench_cli.py``.)"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pandas as pd
import pytest
from test_cli import _error_line
from test_cli_run import _job
from test_endpoint_hardening import pki  # noqa: F401 (the module's certificates)

from federation import certs
from federation.channel import FileTransport
from federation.party_config import PartyConfig
from federation.standing_policy import StandingPolicy
from federation.status import DOWN_AFTER, PartyStatus, Proposal
from privreg import job_cli
from privreg.cli import main
from privreg.party_service import PartyService
from privreg.run_log import PrefectDatabaseError, check_prefect_database
from storage.descriptor import TableRef
from storage.party_store import PartyStore

ROOT = Path(__file__).resolve().parents[1]

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


def test_watch_needs_a_positive_interval(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, ["job", "status", "x", "--config", "c", "--watch", "--every", "0"])
    assert line == "privreg: error: --every must be > 0 seconds (got 0)"


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


def test_watch_looks_again_while_a_side_is_live_and_ends_with_the_run(
    shared: FileTransport, capsys: pytest.CaptureFixture[str]
) -> None:
    for party in PARTIES:
        _publish(shared, party, "running", time.time())
    ending = threading.Timer(
        0.8, lambda: [_publish(shared, p, "done", time.time()) for p in PARTIES]
    )
    ending.start()
    looks = [json.loads(line) for line in _status(capsys, "--watch", "--every", "0.2",
                                                   "--json").splitlines()]  # fmt: skip
    ending.join()
    assert len(looks) >= 3  # looked again while the sides ran, then stopped on its own
    assert [p["state"] for p in looks[0]["parties"]] == ["running"] * 3
    assert [p["state"] for p in looks[-1]["parties"]] == ["done"] * 3


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
            assert _gone(pid), (
                f"{run}: process {pid} still there: "
                + Path(f"/proc/{pid}/status").read_text().splitlines()[1]
            )
        assert not service._sides  # forgotten as well: the limits count live sides only
    finally:
        service.stop()


#: Runs each command (a JSON list of argv lists) in this fresh process; prints, per command,
#: its exit status and the Prefect, ``flows`` and heavy maths packages it left loaded (SciPy,
#: gmpy2 and dp-accounting cost the looking commands a second of CPU).
_LOOK = """
import json, sys
from privreg.cli import main
seen = []
heavy = ("prefect", "flows", "scipy", "gmpy2", "dp_accounting")
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(heavy))
    seen.append({"argv": argv, "code": code, "loaded": loaded})
print(json.dumps(seen))
"""


def _looking_commands(folder: Path, issued: dict[str, certs.Issued]) -> list[list[str]]:
    """``job status``, ``budget show``, ``models list`` and ``job check`` on real files."""
    ref = TableRef(str(folder / "bank.duckdb"), "customers")
    PartyStore.of(ref).import_frame(pd.DataFrame({"id": [1, 2], "x": [0.5, 1.5]}), ref)
    assert main(["budget", "set", "--database", ref.database, "--table", "customers",
                 "--epsilon", "2"]) == 0  # fmt: skip
    config = folder / "party.toml"
    config.write_text(
        f'party = "bank"\nroot = "home"\n[tls]\nca = "{issued["ca"].cert}"\n'
        f'cert = "{issued["bank"].cert}"\nkey = "{issued["bank"].key}"\n'
    )
    record = PartyStatus("bank", "credit", "done", ("bank",), heartbeat=time.time(), seq=1)
    FileTransport(folder / "home").publish_status("credit", "bank", record.to_bytes())
    return [
        ["job", "status", "credit", "--config", str(config), "--json"],
        ["budget", "show", "--database", ref.database],
        ["models", "list", "--database", ref.database],
        ["job", "check", str(ROOT / "jobs" / "demo.json")],
    ]


def test_commands_that_only_look_do_not_load_prefect_or_scipy(
    tmp_path: Path,
    pki: dict[str, certs.Issued],  # noqa: F811
) -> None:
    commands = _looking_commands(tmp_path, pki)
    done = subprocess.run(
        [sys.executable, "-c", _LOOK, json.dumps(commands)], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert [s["code"] for s in seen] == [0] * len(commands), done.stderr
    assert [s["loaded"] for s in seen] == [[]] * len(commands), seen
    assert "valid: " in done.stderr and "Traceback" not in done.stderr


def test_a_prefect_database_that_cannot_be_made_is_one_line_and_the_log(tmp_path: Path) -> None:
    """Not two minutes of a temporary server's start-up tracebacks: one line, the log's path,
    and the reason with its traceback in that log."""
    (tmp_path / "a-file").write_text("")
    job = _job("demo.json", tmp_path, {"vertical": None, "walr": None, "subjobs": None})
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "a-file" / "prefect")  # under a file: cannot be made
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "privreg.cli", "run", str(job), "--log-dir", str(logs)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    (log,) = logs.glob("demo-*.log")
    lines = done.stderr.strip().splitlines()
    assert lines == [lines[0], f"privreg: full log: {log}"], done.stderr
    assert lines[0].startswith("privreg: error: the Prefect database ")
    assert "PREFECT_HOME" in lines[0]
    assert "PrefectDatabaseError" in log.read_text() and done.stdout == ""


def test_a_locked_prefect_database_is_refused_naming_it(tmp_path: Path) -> None:
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )

    database = tmp_path / "prefect.db"
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")  # a writer that does not let go
    url = f"sqlite+aiosqlite:///{database}"
    with temporary_settings({PREFECT_API_URL: None, PREFECT_SERVER_DATABASE_CONNECTION_URL: url}):
        with pytest.raises(PrefectDatabaseError, match=f"{database} is locked by another"):
            check_prefect_database(patience=0.2)
        holder.rollback()
        check_prefect_database(patience=0.2)  # let go: accepted
    holder.close()


@pytest.mark.parametrize(
    ("argv", "typo", "meant"),
    [(["modles", "list"], "modles", "models"), (["job", "stauts", "x"], "stauts", "status"),
     (["budget", "shwo", "--database", "x"], "shwo", "show"),
     (["party", "psi", "--config", "x", "--table", "t", "--peer", "p", "--job", "j",
       "--protocol", "kkr"], "kkr", "kkrt")],  # a stage's flags, added when parsed
)  # fmt: skip
def test_a_mistyped_command_gets_the_closest_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], typo: str, meant: str
) -> None:
    line = _error_line(capsys, argv)
    assert f"invalid choice: {typo!r}" in line and line.endswith(f"did you mean {meant!r}?")


def test_a_choice_nothing_like_any_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    assert "did you mean" not in _error_line(capsys, ["xyzzy"])


def test_a_party_commands_usage_error_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, ["party", "walr", "--config", "x"])
    assert line.startswith("privreg party walr: error: the following arguments are required")
