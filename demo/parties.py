"""The whole demo job with every organisation its own OS process, over mTLS on loopback.

Every party the demo's job files name gets a folder ``var/orgs/<party>/``: its certificate
and key, its ``party.toml``, its own Prefect home, a copy of every job file (``jobs/``) and
of its own source files only (``demo/...``); its database is created there when it loads.
The clinic and the lab (main job: PSI, vertical LR, WALR), the arbiter (vertical LR's key),
the registry and the clinic again (label DP), three hospitals and the coordinator
(horizontal LR, then sparse LDA). Each starts its message endpoint (``privreg party serve``)
and then ``privreg party pipeline --job-file jobs/demo.json`` in its own folder: it runs the
stages that name it, in the job's order, and prints one line per stage. A party's log is
``var/orgs/<party>/pipeline.log``.

Budgets: a job file never grants one to a party service, so each owner names its tables'
budgets in its own ``party.toml`` (``[budgets.<table>]``); for the demo, each owner takes the
figures the job files suggest (:func:`owner_budgets_toml`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.job_files import read_job
from core.job_schema import job_kind
from core.paillier.keys import SMALL_KEYS_VARIABLE
from demo.orgs import CLI, Org, env_of, make_orgs, serve_all, start
from flows.pipeline_party import organisations, participants
from storage.descriptor import TableRef

ROOT = Path(__file__).resolve().parents[1]
ORGS_VARIABLE = "PRIVREG_DEMO_ORGS"  # where the organisations' folders go (a benchmark's own)
ORGS = Path(os.environ.get(ORGS_VARIABLE) or ROOT / "var" / "orgs")
JOB_FILE = "jobs/demo.json"
STARTUP = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
SMALL_KEYS = {SMALL_KEYS_VARIABLE: "1"}
"""A party process's own opt-in to :func:`small_main_job`'s keys (``extra`` environment)."""


def prepare(
    root: Path, job_file: str = JOB_FILE, source: Path = ROOT, receive_timeout: float = 900
) -> dict[str, Org]:
    """A CA and one folder per party of ``job_file`` (read from ``source``): every job file,
    and the party's own source files, at the paths the job files give them."""
    holds = organisations(job_file, source)
    orgs = make_orgs(root, sorted(holds), receive_timeout)
    job_files = [job_file, *read_job(source / job_file).get("subjobs", {}).values()]
    budgets = owner_budgets_toml([source / path for path in job_files])
    for party, org in orgs.items():
        for path in [*job_files, *holds[party]]:
            (org.folder / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / path, org.folder / path)
        with org.config.open("a") as config:  # the owner's own decision, in its own file
            config.write(budgets.get(party, ""))
    return orgs


def small_main_job(source: Path) -> None:
    """The demo's main job shrunk for tests and benchmarks, under ``source/jobs/demo.json``:
    no sub-jobs, no WALR, one vertical epoch, 1024-bit keys (``source/demo`` links the data;
    each party process that runs it needs :data:`SMALL_KEYS` in its environment)."""
    job = read_job(ROOT / JOB_FILE)
    job.pop("subjobs")
    job.pop("walr")
    job["vertical"].update(epochs=1, key_size=1024)
    (source / "jobs").mkdir(parents=True)
    (source / JOB_FILE).write_text(json.dumps(job))
    (source / "demo").symlink_to(ROOT / "demo")


def owner_budgets_toml(job_files: list[Path]) -> dict[str, str]:
    """Each owner's ``[budgets.<table>]`` entries, with the figures the job files suggest."""
    entries: dict[str, str] = {}
    for job_file in job_files:
        for entry in read_job(job_file)["parties"].values():
            budget = entry.get("privacy_budget")
            if budget:
                ref = TableRef.from_dict(entry["table"])
                entries[ref.party] = entries.get(ref.party, "") + (
                    f"\n[budgets.{ref.table}]\nepsilon = {float(budget['epsilon'])!r}\n"
                    f"delta = {float(budget.get('delta', 0.0))!r}\n"
                )
    return entries


def run_job(
    orgs: dict[str, Org],
    job_file: str = JOB_FILE,
    run: str = "",
    extra: dict[str, str] | None = None,
    timeout: float = 1800,
) -> dict[str, dict[str, Any]]:
    """Every party's endpoint, then every party's ``privreg party pipeline``; returns each
    party's result once all have finished (the first failure stops the others)."""
    servers = serve_all(orgs.values(), extra)
    runs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        for party, org in orgs.items():
            log = org.folder / "pipeline.log"
            with log.open("a") as stderr:
                args = ["--job-file", job_file, *(["--run", run] if run else [])]
                runs[party] = (start(org, "pipeline", args, extra, stderr=stderr), log)
        return _finish(runs, timeout)
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for server in servers:
            server.terminate()
            server.wait(timeout=10)


def _finish(
    runs: dict[str, tuple[subprocess.Popen, Path]], timeout: float
) -> dict[str, dict[str, Any]]:
    deadline, results = time.monotonic() + timeout, {}
    while len(results) < len(runs):
        for party, (process, log) in runs.items():
            if party in results or process.poll() is None:
                continue
            out = process.stdout.read() if process.stdout else ""
            if process.returncode:
                tail = "\n".join(log.read_text().splitlines()[-15:])
                raise RuntimeError(
                    f"{party}'s pipeline failed (exit {process.returncode}):\n{tail}"
                )
            *lines, result = out.strip().splitlines()
            print("\n".join(lines), flush=True)
            results[party] = json.loads(result)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"still running after {timeout:.0f} s: {sorted(set(runs) - set(results))}"
            )
        time.sleep(0.2)
    return results


INITIATORS = ("clinic", "coordinator")
"""Who proposes in the demo: the clinic the main job and label DP (its jobs), the coordinator
the hospitals' sub-jobs; every other organisation's service starts its side on its own."""


def accept_proposals(orgs: dict[str, Org], initiators: tuple[str, ...] = INITIATORS) -> None:
    """Each other organisation's standing policy: take part when an initiator proposes."""
    for party, org in orgs.items():
        if party not in initiators:
            with org.config.open("a") as config:
                config.write(f"\n[policy]\naccept_from = {json.dumps(list(initiators))}\n")


def propose_job(
    orgs: dict[str, Org],
    run: str,
    job_file: str = JOB_FILE,
    initiators: tuple[str, ...] = INITIATORS,
    extra: dict[str, str] | None = None,
    timeout: float = 1800,
    source: Path = ROOT,
) -> None:
    """Every party's endpoint and service; the initiators run ``privreg job start``, the
    others start when proposed to. Prints every party's stage lines once every job is done."""
    servers = serve_all(orgs.values(), extra)
    starts: dict[str, subprocess.Popen] = {}
    try:
        for party in initiators:
            org = orgs[party]
            command = [*CLI[:-1], "job", "start", job_file, "--config", str(org.config)]
            with (org.folder / "pipeline.log").open("a") as log:
                starts[party] = subprocess.Popen(
                    [*command, "--run", run], cwd=org.folder, env=env_of(org, extra),
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
        deadline = time.monotonic() + timeout
        for party, process in starts.items():
            if process.wait(timeout=max(deadline - time.monotonic(), 1)):
                tail = (orgs[party].folder / "pipeline.log").read_text().splitlines()[-15:]
                raise RuntimeError(f"{party}'s job start failed:\n" + "\n".join(tail))
        sides = _sides(job_file, run, source)
        ended = ("done", "failed", "aborted")
        while unfinished := [s for s in sides if _state(orgs, *s) not in ended]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"still running after {timeout:.0f} s: {unfinished}")
            time.sleep(0.5)
        if failed := [s for s in sides if _state(orgs, *s) != "done"]:
            raise RuntimeError(f"failed: {failed}")
        for party, org in orgs.items():
            for log in [org.folder / "pipeline.log", *org.folder.glob("home/runs/*/pipeline.log")]:
                lines = log.read_text().splitlines() if log.exists() else []
                print("\n".join(line for line in lines if line.startswith(f"{party} ")))
    finally:
        for process in starts.values():
            if process.poll() is None:
                process.kill()
        for server in servers:  # each service ends any side it started
            server.terminate()
            server.wait(timeout=60)


def _sides(job_file: str, run: str, source: Path) -> list[tuple[str, str]]:
    """(party, job run) for every job of the file (read from ``source``) and its parties."""
    main = read_job(source / job_file)
    files = [(job_kind(main), job_file), *main.get("subjobs", {}).items()]
    jobs = [(kind, read_job(source / path), Path(path).stem) for kind, path in files]
    return [
        (party, f"{spec.get('job') or stem}-{run}")
        for kind, spec, stem in jobs
        for party in sorted(participants(kind, spec))
    ]


def _state(orgs: dict[str, Org], party: str, job: str) -> str:
    record = orgs[party].folder / "home" / "runs" / job / "status" / party
    return json.loads(record.read_text())["state"] if record.exists() else "not started"


def main() -> None:
    shutil.rmtree(ORGS, ignore_errors=True)  # a fresh demo: new keys, new jobs
    started = time.perf_counter()
    orgs = prepare(ORGS)
    accept_proposals(orgs)
    print(f"{len(orgs)} organisations under {ORGS}: {', '.join(orgs)}", flush=True)
    run = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    print(f"{' and '.join(INITIATORS)} propose run {run}; the others start on their own")
    # every party's process starts its own temporary Prefect API, all at once: give them time
    patience = max(float(os.environ.get(STARTUP, 0)), 900.0)
    propose_job(orgs, run, extra={STARTUP: str(patience)})
    print(f"every party finished its stages in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
