"""``privreg demo``: the demo job of ``make demo``, run from an installed package.

``make demo`` runs in the repository, reading ``jobs/demo.json`` and the sources it names from
the current folder. An installed privreg has no repository, so this command first writes the
demo's files (package data, see :mod:`privreg.bundled`) into a folder of their own, then runs
the job there exactly as ``privreg run`` does, so every relative path of the job files (sources,
databases, sub-job files) lands in that folder and nowhere else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from privreg import bundled

#: What the folder holds once the demo ran, for the closing lines.
_LAYOUT = (
    ("jobs/", "the job files: edit one, then `privreg run jobs/demo.json` in this folder"),
    ("demo/", "each party's source file"),
    (
        "var/parties/",
        "each party's database; its models: `privreg models list --database "
        "var/parties/<party>.duckdb`",
    ),
    ("var/runs/", "the messages that crossed between the parties"),
    ("var/logs/", "Prefect's log lines of each run"),
)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the ``privreg`` command."""
    demo = commands.add_parser(
        "demo", help="write the bundled demo into a folder and run it there (no checkout needed)"
    )
    demo.add_argument(
        "--dir",
        default="privreg-demo",
        help="folder for the demo's job files, sources and var/ ('.': the current folder)",
    )
    demo.add_argument(
        "--job",
        help="one sub-job of the demo run alone: label_dp, horizontal_lr or sparse_lda "
        "(None: the main job and every sub-job)",
    )
    demo.set_defaults(handler=_demo)


def _job_file(job: str | None) -> str:
    """The job file to run, relative to the demo's folder: the main job, or the sub-job ``job``
    as the bundled main job names it (checked before anything is written)."""
    if job is None:
        return bundled.MAIN_JOB
    main = bundled.demo_root().joinpath(*bundled.MAIN_JOB.split("/"))
    subjobs = json.loads(main.read_text(encoding="utf-8")).get("subjobs", {})
    if job not in subjobs:
        raise ValueError(f"the demo has no sub-job {job!r}: one of {', '.join(subjobs)}")
    return subjobs[job]


def _demo(args: argparse.Namespace) -> None:
    """Copy the demo's files into ``--dir``, run its job there, print where everything is."""
    folder = Path(args.dir).resolve()
    job_file = _job_file(args.job)
    copied = list(bundled.copy_demo(folder))
    kept = [name for name, written in copied if not written]
    # as make demo: Prefect's temporary API keeps its state beside the run
    os.environ.setdefault("PREFECT_HOME", str(folder / "var" / "prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    note = f" ({len(kept)} already there were kept as they are)" if kept else ""
    print(f"privreg demo: {len(copied)} job and source files in {folder}{note}", file=sys.stderr)
    print(f"privreg demo: running {job_file} there", file=sys.stderr)

    from privreg import cli  # imported here: cli registers this command

    run = argparse.Namespace(
        job_file=job_file, workspace=None, run="", log_dir=str(folder / "var" / "logs")
    )
    with contextlib.chdir(folder):  # the job's relative paths are read from the current folder
        cli._run(run)
    print(f"\nThe demo's folder: {folder}")
    for name, what in _LAYOUT:
        print(f"  {name:<13} {what}")
