"""``privreg run`` on the terminal: one progress line per stage, Prefect's log lines in a file,
and an error (a budget refusal here) as one line plus where the full log is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prefect.logging.configuration import ensure_logging_setup

from privreg.cli import main

ensure_logging_setup()  # Prefect's console handler on the real stderr, not on a test's capture

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]


def _job(name: str, folder: Path, change: dict[str, object]) -> Path:
    """A bundled job file with its databases in ``folder`` and sources from the repository."""
    job = {**json.loads((ROOT / "jobs" / name).read_text()), **change}
    for entry in job["parties"].values():
        entry["source"] = str(ROOT / entry["source"])
        entry["table"]["database"] = str(folder / Path(entry["table"]["database"]).name)
    path = folder / name
    path.write_text(json.dumps({k: v for k, v in job.items() if v is not None}))
    return path


def _lines(text: str) -> tuple[list[str], list[str]]:
    """(progress lines, every other line) of what ``privreg run`` wrote to stderr."""
    lines = text.strip().splitlines()
    return [x for x in lines if x.startswith("[")], [x for x in lines if not x.startswith("[")]


def test_run_prints_a_line_per_stage_and_keeps_prefect_s_lines_in_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job("demo.json", tmp_path, {"vertical": None, "walr": None, "subjobs": None})
    logs = tmp_path / "logs"
    argv = ["run", str(job), "--workspace", str(tmp_path), "--log-dir", str(logs)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    progress, other = _lines(captured.err)
    done = [re.match(r"\[ *[0-9.]+ s\] (\w+) demo/(\w+) \(", line) for line in progress]
    assert sorted(m.groups() for m in done if m) == [
        ("clinic", "load"),
        ("clinic", "psi"),
        ("lab", "load"),
        ("lab", "psi"),
    ], captured.err  # each party's stages, as each finishes
    assert len(other) == 1 and other[0].startswith("finished in"), captured.err
    assert "INFO" not in captured.err + captured.out and "470 shared rows" in captured.out
    (log,) = logs.glob("demo-*.log")
    assert str(log) in other[0]
    text = log.read_text()
    assert "Beginning flow run" in text and "Finished in state Completed" in text


def test_a_budget_refusal_is_one_line_and_the_log_has_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The label-DP sub-job file runs on its own (and says so); its release asks for more
    epsilon than the registry's budget holds."""
    original = json.loads((ROOT / "jobs/label_dp_demo.json").read_text())
    parties = original["parties"]
    parties["guest"]["privacy_budget"] = {"epsilon": 1.0, "delta": 0.0}
    job = _job("label_dp_demo.json", tmp_path, {"parties": parties})
    logs = tmp_path / "logs"
    argv = ["run", str(job), "--workspace", str(tmp_path), "--log-dir", str(logs)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    _, other = _lines(captured.err)
    (log,) = logs.glob("label_dp_demo-*.log")
    assert other[0] == f"{job} is a label_dp sub-job: running it on its own"
    assert other[1].startswith("privreg: error: ") and "budget" in other[1], captured.err
    assert other[2:] == [f"privreg: full log: {log}"], captured.err
    assert "Traceback" not in captured.err and "INFO" not in captured.err
    text = log.read_text()
    assert "Traceback" in text and "BudgetError" in text


def test_a_sub_job_file_says_which_main_job_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    from privreg.cli import _sub_job_line

    line = _sub_job_line(ROOT / "jobs/horizontal_demo.json", "horizontal_lr")
    assert line.endswith("is a horizontal_lr sub-job (named in demo.json): running it on its own")
