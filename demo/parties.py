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

from demo.orgs import Org, make_orgs, serve_all, start
from flows.jobs import read_job
from flows.pipeline_party import organisations
from storage.descriptor import TableRef

ROOT = Path(__file__).resolve().parents[1]
ORGS = ROOT / "var" / "orgs"
JOB_FILE = "jobs/demo.json"
STARTUP = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


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


def main() -> None:
    shutil.rmtree(ORGS, ignore_errors=True)  # a fresh demo: new keys, new jobs
    started = time.perf_counter()
    orgs = prepare(ORGS)
    print(f"{len(orgs)} organisations under {ORGS}: {', '.join(orgs)}", flush=True)
    # every party's process starts its own temporary Prefect API, all at once: give them time
    patience = max(float(os.environ.get(STARTUP, 0)), 900.0)
    run_job(orgs, extra={STARTUP: str(patience)})
    print(f"every party finished its stages in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
