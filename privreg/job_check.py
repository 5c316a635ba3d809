"""``privreg job check FILE`` and ``privreg job schema``: a job file as privreg reads it.

``check`` validates a job file and the sub-job files it names (``core/job_schema.py``) and
prints it with every default filled in; ``schema --markdown`` prints the job-file reference
(docs/reference/job-file.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from types import ModuleType


def job_files() -> ModuleType:
    """``flows.jobs`` (read and validate job files) without importing the ``flows`` package:
    the package's ``__init__`` sets Prefect up (a second of CPU and Prefect's warnings), which
    a command that only reads job files has no use for. The module itself needs only
    ``core.job_schema``; once ``flows`` is imported, its own ``flows.jobs`` is used."""
    if (loaded := sys.modules.get("flows.jobs")) is not None:
        return loaded
    if (alone := sys.modules.get(_ALONE)) is not None:
        return alone
    package = importlib.util.find_spec("flows")  # finds the folder, runs nothing
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("privreg's flows package is not installed")
    folder = package.submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(_ALONE, f"{folder}/jobs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_ALONE] = module
    return module


_ALONE = "privreg._flows_jobs"  # flows/jobs.py loaded on its own (see job_files)


def check(args: argparse.Namespace) -> None:
    """Print the validated job (JSON, defaults filled in); a bad file raises its short error."""
    jobs = job_files()
    load_job, load_job_tree = jobs.load_job, jobs.load_job_tree

    job = load_job(args.job_file)
    checked = [args.job_file]
    if getattr(job, "subjobs", None) is not None:
        tree = load_job_tree(args.job_file)
        checked += [f"{kind} {path}" for kind, path in job.subjobs.model_dump().items() if path]
        assert len(tree) == len(checked)
    print(json.dumps(job.model_dump(mode="json"), indent=2))
    print(f"valid: {', '.join(checked)}", file=sys.stderr)


def schema(args: argparse.Namespace) -> None:
    """Print the job-file reference (markdown), as generated from the schema."""
    from flows.job_reference import markdown

    print(markdown(), end="")


def register_check(actions: argparse._SubParsersAction) -> None:
    """Add ``check`` and ``schema`` to the ``privreg job`` actions."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = actions.add_parser(
        "check",
        help="validate a job file and its sub-jobs; print it with every default filled in",
        formatter_class=formatter,
    )
    parser.add_argument("job_file", help="the job file (JSON)")
    parser.set_defaults(handler=check)
    parser = actions.add_parser(
        "schema", help="print the job-file reference", formatter_class=formatter
    )
    parser.add_argument(
        "--markdown", action="store_true", default=True, help="as markdown (the only format)"
    )
    parser.set_defaults(handler=schema)
