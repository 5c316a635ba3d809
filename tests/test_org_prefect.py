"""One Prefect per organisation: the party service starts the organisation's server (or uses
the one it is given), every side it starts reports there as a flow run (no temporary server of
its own), the ``privreg job`` commands at that party find it through the URL file, and
stopping the service leaves no server process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prefect_api import api

from core.lifetime import descendants
from federation.party_config import PartyConfig, PartyConfigError
from federation.status import Proposal
from privreg import job_cli
from privreg.cli import main
from privreg.org_prefect import (
    ENV,
    OrgPrefect,
    OrgPrefectError,
    side_prefect,
    url_file,
    use_org_prefect,
)
from privreg.party_service import PartyService

ROOT = Path(__file__).resolve().parents[1]
PARTY_TOML = """party = "lab"
root = "home"
{extra}
[tls]
ca = "ca.pem"
cert = "lab.pem"
key = "lab.key"

[policy]
accept_from = ["clinic"]
"""


def _lab(folder: Path, extra: str = "") -> Path:
    """The lab's folder: its party.toml and a job file its side refuses at once (no stages),
    after its flow run has started."""
    (folder / "jobs").mkdir(parents=True)
    (folder / "jobs" / "demo.json").write_text('{"job": "demo"}')
    path = folder / "party.toml"
    path.write_text(PARTY_TOML.format(extra=extra))
    return path


def _wait_until(predicate: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within:.0f} s: {what}"
        time.sleep(0.2)


def test_the_service_hosts_the_server_its_sides_report_to_and_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    config_path = _lab(tmp_path / "lab")
    config = PartyConfig.load(config_path)
    org = OrgPrefect.for_party(config)
    service = PartyService(config, config_path, org)
    try:
        said: list[str] = []
        org.wait_ready(said.append)
        assert said[0].startswith(f"party lab waiting for its Prefect server to answer at "
                                  f"{org.api_url}/health since ")  # fmt: skip
        assert f"UI {org.ui_url}, API {org.api_url}" in said[1]
        assert org.process is not None and org.process.poll() is None
        home = config.root / "prefect"
        assert (home / "prefect.db").exists()  # its state under the party's root
        written = url_file(config.root)
        assert written.read_text().strip() == org.api_url
        assert stat.S_IMODE(written.stat().st_mode) == 0o600

        answer = service("clinic", Proposal("jobs/demo.json", "r1"))
        assert "started its side of demo-r1" in answer
        side = service._sides["demo-r1"][1]
        assert side.wait(timeout=120) != 0  # refused its job file, after its run started
        env = {ENV: org.api_url}
        runs = api(env, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [
            "lab: pipeline jobs/demo.json run r1"]}}})  # fmt: skip
        assert [run["state_type"] for run in runs] == ["FAILED"]  # on the org's server
        log = (config.root / "runs" / "demo-r1" / "pipeline.log").read_text()
        assert "temporary server" not in log.lower()  # no Prefect of its own

        assert use_org_prefect(config) == org.api_url  # a job command at this party
        assert os.environ[ENV] == org.api_url
        monkeypatch.delenv(ENV)
        _a_side_started_by_hand_reports_there(config_path, env)
        _a_schedule_is_served_there(config_path, env)
    finally:
        service.stop()
        family = {org.process.pid, *descendants(org.process.pid)} if org.process else set()
        org.stop()
    assert org.process.poll() is not None
    _wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in family), 20,
                "the server and every process under it gone")  # fmt: skip
    assert not url_file(config.root).exists()
    assert use_org_prefect(config) is None and ENV not in os.environ


def _child_env() -> dict[str, str]:
    """A command's environment as a user's shell gives it: no PREFECT_API_URL, no party."""
    child = {k: v for k, v in os.environ.items() if k != ENV and not k.startswith("PRIVREG_")}
    child["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child.get("PYTHONPATH")) if p)
    return child


def _a_side_started_by_hand_reports_there(config_path: Path, env: dict[str, str]) -> None:
    """``privreg party pipeline`` typed at the lab, without PREFECT_API_URL, reports its flow
    run to the organisation's server (no temporary one, no line saying so)."""
    command = [sys.executable, "-m", "privreg.cli", "party", "pipeline", "--config",
               "party.toml", "--job-file", "jobs/demo.json", "--run", "by-hand"]  # fmt: skip
    done = subprocess.run(command, cwd=config_path.parent, env=_child_env(),
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode != 0  # the job file has no stages: refused, after its run started
    assert "temporary" not in done.stderr, done.stderr
    runs = api(env, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [
        "lab: pipeline jobs/demo.json run by-hand"]}}})  # fmt: skip
    assert [run["state_type"] for run in runs] == ["FAILED"], done.stderr


def _a_schedule_is_served_there(config_path: Path, env: dict[str, str]) -> None:
    """``privreg job schedule`` run without PREFECT_API_URL serves its cron deployment on the
    organisation's server (a temporary one refuses schedules)."""
    child = _child_env()
    command = [sys.executable, "-m", "privreg.cli", "job", "schedule", "jobs/demo.json",
               "--config", "party.toml", "--cron", "0 2 * * *"]  # fmt: skip
    schedule = subprocess.Popen(command, cwd=config_path.parent, env=child,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        body = {"deployments": {"name": {"any_": ["lab-demo"]}}}
        _wait_until(lambda: bool(api(env, "/deployments/filter", body)) or
                    schedule.poll() is not None, 90, "the deployment lab-demo")  # fmt: skip
        assert schedule.poll() is None, "job schedule ended"
        [deployment] = api(env, "/deployments/filter", body)
        assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]
    finally:
        schedule.terminate()
        schedule.wait(timeout=30)


def test_a_stale_url_file_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service killed with SIGKILL leaves its file: the commands use a temporary server, and
    a side started by hand says so in one line (as it does when no service ever ran)."""
    monkeypatch.delenv(ENV, raising=False)
    config = PartyConfig.load(_lab(tmp_path / "lab"))
    said: list[str] = []
    assert side_prefect(config, said.append) is None
    assert said == [f"party lab: the organisation's Prefect server is not up (no "
                    f"{url_file(config.root)}: privreg party serve is not running); this side "
                    f"runs on a temporary Prefect server of its own"]  # fmt: skip
    config.root.mkdir()
    url_file(config.root).write_text("http://127.0.0.1:9/api\n")
    assert use_org_prefect(config) is None and ENV not in os.environ
    assert side_prefect(config, said.append) is None and ENV not in os.environ
    assert said[1].startswith("party lab: the organisation's Prefect server is not up "
                              "(http://127.0.0.1:9/api (from ")  # fmt: skip
    assert said[1].endswith("does not answer); this side runs on a temporary Prefect server "
                            "of its own")  # fmt: skip


def test_a_given_server_that_does_not_answer_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "http://127.0.0.1:9/api")
    config = PartyConfig.load(_lab(tmp_path / "lab"))
    with pytest.raises(OrgPrefectError, match=r"http://127.0.0.1:9/api \(PREFECT_API_URL\) does "
                       r"not answer at http://127.0.0.1:9/api/health"):  # fmt: skip
        OrgPrefect.for_party(config)
    monkeypatch.delenv(ENV)
    given = '[prefect]\napi_url = "http://127.0.0.1:9/api"'
    config = PartyConfig.load(_lab(tmp_path / "lab2", given))
    with pytest.raises(OrgPrefectError, match=r"prefect.api_url in its party.toml"):
        OrgPrefect.for_party(config)
    assert not config.root.exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    ("table", "refusal"),
    [
        ("port = 4200\napi_url = 'http://h:4200/api'", "exclude each other"),
        ("port = 'x'", "prefect.port must be a port number"),
        ("api_url = 'h:4200'", "prefect.api_url must be a URL"),
        ("host = 'h'", r"unknown prefect keys \['host'\]"),
    ],
)
def test_the_prefect_table_is_checked(tmp_path: Path, table: str, refusal: str) -> None:
    with pytest.raises(PartyConfigError, match=refusal):
        PartyConfig.load(_lab(tmp_path / "lab", f"[prefect]\n{table}\n"))


def test_a_schedule_without_a_server_that_stays_up_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    config_path = _lab(tmp_path / "lab")
    monkeypatch.setattr(job_cli, "_as_party", PartyConfig.load)
    job = str(config_path.parent / "jobs" / "demo.json")
    with pytest.raises(SystemExit, match=r"job schedule needs a Prefect server that stays up"):
        main(["job", "schedule", job, "--config", str(config_path), "--cron", "0 2 * * *"])
