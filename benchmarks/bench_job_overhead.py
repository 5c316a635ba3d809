"""A 3-party vertical job's end-to-end time against its training time (part of ``make
bench-federation``).

The clinic (guest), the lab (host) and the arbiter each run ``privreg party serve`` in their
own folder, every service hosting its organisation's Prefect server, the others accepting the
clinic's proposals. Once every server answers, the clinic runs ``privreg job start`` of the
demo's main job without its sub-jobs and WALR (PSI, then vertical LR on the ~470 shared rows
with the demo's options: 2048-bit keys, 4 epochs); the lab's and the arbiter's services start
their sides when proposed to. Measured, per run:

* end to end: ``job start`` launched to the last side's status "done";
* training: the vertical LR stage's seconds at the guest (its stage line);
* PSI: the PSI stage's seconds at the guest;
* overhead: end to end minus training (target: at most 15 s).

The services' own start (each one's Prefect server coming up) is before the clock starts:
it happens once per organisation, not per job.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.job_files import read_job  # noqa: E402
from demo.orgs import CLI, Org, env_of, serve_all  # noqa: E402
from demo.parties import JOB_FILE, accept_proposals, prepare  # noqa: E402

TARGET = 15.0
PARTIES = ("clinic", "lab", "arbiter")
STAGE = re.compile(r"^clinic \S+/(?P<stage>\w+) \([a-z]+, (?P<seconds>[\d.]+) s\)")


def vertical_job(source: Path) -> None:
    """The demo's main job without sub-jobs and WALR, under ``source/jobs/demo.json``."""
    job = read_job(ROOT / JOB_FILE)
    job.pop("subjobs")
    job.pop("walr")
    (source / "jobs").mkdir(parents=True)
    (source / JOB_FILE).write_text(json.dumps(job))
    (source / "demo").symlink_to(ROOT / "demo")


def _state(org: Org, job: str) -> str:
    record = org.folder / "home" / "runs" / job / "status" / org.party
    return json.loads(record.read_text())["state"] if record.exists() else "not started"


def _wait(what: str, ready, patience: float) -> None:
    deadline = time.monotonic() + patience
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {patience:.0f} s: {what}")
        time.sleep(0.2)


def one_job(orgs: dict[str, Org], run: str, patience: float = 900) -> dict[str, float]:
    """``job start`` at the clinic; seconds end to end and of its PSI and vertical stages."""
    clinic, job = orgs["clinic"], f"{read_job(ROOT / JOB_FILE)['job']}-{run}"
    command = [*CLI[:-1], "job", "start", JOB_FILE, "--config", str(clinic.config), "--run", run]
    began = time.monotonic()
    started = subprocess.run(command, cwd=clinic.folder, env=env_of(clinic), text=True,
                             capture_output=True, timeout=patience)  # fmt: skip
    if started.returncode:
        raise RuntimeError(f"job start failed:\n{started.stderr[-2000:]}")
    _wait(f"every side of {job} done", lambda: all(_state(orgs[p], job) in ("done", "failed")
                                                   for p in PARTIES), patience)  # fmt: skip
    ended = time.monotonic() - began
    if failed := [p for p in PARTIES if _state(orgs[p], job) != "done"]:
        raise RuntimeError(f"{job} failed at {failed}")
    stages = {m["stage"]: float(m["seconds"]) for line in started.stdout.splitlines()
              if (m := STAGE.match(line))}  # fmt: skip
    training = stages["vertical"]
    return {"end to end": ended, "training": training, "psi": stages.get("psi", 0.0),
            "overhead": ended - training}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the folders")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="privreg-bench-overhead-"))
    try:
        vertical_job(root / "source")
        orgs = prepare(root / "orgs", source=root / "source", receive_timeout=300)
        orgs = {p: orgs[p] for p in PARTIES}
        accept_proposals(orgs, initiators=("clinic",))
        servers = serve_all(orgs.values())
        try:
            for org in orgs.values():  # each organisation's Prefect server, once
                url = org.folder / "home" / "prefect-api-url"
                _wait(f"{org.party}'s Prefect server", url.exists, 300)
            runs = [one_job(orgs, f"o{i}") for i in range(args.repeats)]
        finally:
            for server in servers:
                server.terminate()
            for server in servers:
                server.wait(timeout=60)
    finally:
        if args.keep:
            print(f"folders kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print("\n3-party vertical job (PSI + vertical LR, ~470 rows, 2048-bit keys, 4 epochs), "
          f"services and Prefect servers up; median of {args.repeats}")  # fmt: skip
    print(f"{'what':<34} {'seconds':>8}  target")
    for what in ("end to end", "psi", "training", "overhead"):
        target = f"<= {TARGET:.0f} s" if what == "overhead" else ""
        label = {"psi": "PSI stage", "training": "training (vertical LR stage)",
                 "end to end": "end to end (job start -> all done)",
                 "overhead": "overhead (end to end - training)"}[what]  # fmt: skip
        print(f"{label:<34} {statistics.median(r[what] for r in runs):8.1f}  {target}")
    print("each run:", [{k: round(v, 1) for k, v in r.items()} for r in runs])


if __name__ == "__main__":
    main()
