"""The README's recipes fire as written: three organisations, each running ``privreg party
serve`` (which hosts its Prefect server), the clinic's nightly schedule of a job, its "run it
now" command, and a side killed with SIGKILL mid-run restarted by the resume command in its own
folder; every side of that run ends done.

The commands are read from the README's Recipes section and run by a shell in the
organisations' folders, as a user types them (``RUN`` replaced by the run the schedule made).
Lean: one set of organisations, one run; the job is the demo's main job shrunk (1024-bit keys,
no WALR or sub-jobs), named ``credit`` as in the tutorial.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core.job_files import read_job
from core.lifetime import descendants
from demo.orgs import Org, env_of, serve_all, stop_all
from demo.parties import JOB_FILE, SMALL_KEYS, accept_proposals, prepare
from federation.status import LIVE

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobs/credit.json"
PARTIES = ("clinic", "lab", "arbiter")

pytestmark = pytest.mark.slow


def recipe_commands() -> list[str]:
    """The shell lines of the README's Recipes section's code blocks, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def _credit_job(source: Path) -> None:
    job = read_job(ROOT / JOB_FILE)
    job.pop("subjobs")
    job.pop("walr")
    job["job"] = "credit"
    job["vertical"].update(key_size=1024)
    (source / "jobs").mkdir(parents=True)
    (source / JOB).write_text(json.dumps(job))
    (source / "demo").symlink_to(ROOT / "demo")


def _wait(what: str, ready: Callable[[], object], within: float) -> object:
    deadline = time.monotonic() + within
    while not (found := ready()):
        assert time.monotonic() < deadline, f"not within {within:.0f} s: {what}"
        time.sleep(0.3)
    return found


def _shell(org: Org, line: str, **kw) -> subprocess.Popen:
    """``line`` as typed in ``org``'s folder, ``privreg`` and ``prefect`` on the PATH."""
    env = env_of(org, SMALL_KEYS)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.Popen(["bash", "-c", line], cwd=org.folder, env=env, text=True, **kw)


def _state(org: Org, job: str) -> str:
    record = org.folder / "home" / "runs" / job / "status" / org.party
    return json.loads(record.read_text())["state"] if record.exists() else "not started"


def test_the_readme_recipes_schedule_run_now_and_restart_a_killed_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a user's shell names no Prefect server (an earlier test's may linger in this process's
    # environment): each service hosts its organisation's own, as the recipe says
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    schedule, run_now, listing, watch, resume = recipe_commands()
    assert schedule.split("#")[0].rstrip().endswith("&")  # it keeps serving
    _credit_job(tmp_path / "source")
    orgs = prepare(tmp_path / "orgs", job_file=JOB, source=tmp_path / "source")
    orgs = {party: orgs[party] for party in PARTIES}
    accept_proposals(orgs, initiators=("clinic",))
    services = serve_all(orgs.values(), SMALL_KEYS)
    clinic, lab = orgs["clinic"], orgs["lab"]
    started: list[subprocess.Popen] = []
    try:
        for org in orgs.values():
            _wait(f"{org.party}'s Prefect server", (org.folder / "home/prefect-api-url").exists,
                  300)  # fmt: skip
        foreground = schedule.split("#")[0].rstrip().removesuffix("&")
        started.append(_shell(clinic, foreground, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL))  # fmt: skip
        deadline = time.monotonic() + 180
        while (now := _shell(clinic, run_now, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)).wait(timeout=120):  # fmt: skip
            assert time.monotonic() < deadline, now.stdout.read()  # the deployment not there yet
            time.sleep(2)
        found = _wait("the run now's folder", lambda: re.findall(
            r"^credit-(\d{8}T\d{6})$", _shell(clinic, listing, stdout=subprocess.PIPE)
            .communicate()[0], flags=re.MULTILINE), 240)  # fmt: skip
        [run] = found
        job = f"credit-{run}"
        aligning = lab.folder / "home" / "runs" / f"credit-psi-{run}"
        side = _wait("the lab's side aligning",
                     lambda: aligning.exists() and _lab_side(services[1], run), 300)  # fmt: skip
        os.kill(side, signal.SIGKILL)
        assert _state(lab, job) in LIVE  # killed mid-run, its live record left behind
        restart = _shell(lab, resume.replace("RUN", run), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)  # fmt: skip
        started.append(restart)
        watching = _shell(clinic, watch.replace("RUN", run), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)  # fmt: skip
        started.append(watching)
        out = restart.communicate(timeout=600)[0]
        assert restart.returncode == 0, out[-3000:]
        watching.communicate(timeout=120)  # --watch ends when the run does
        assert {p: _state(orgs[p], job) for p in PARTIES} == dict.fromkeys(PARTIES, "done")
        assert re.search(r"^lab credit/vertical \(host, [\d.]+ s\)", out, re.MULTILINE), out
    finally:
        stop_all(started, patience=30)
        stop_all(services)


def _lab_side(service: subprocess.Popen, run: str) -> int | None:
    """The pid of the side the lab's service started for ``run`` (its ``party pipeline``)."""
    for pid in descendants(service.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pipeline" in argv and run.encode() in argv:
            return pid
    return None
