"""``privreg job check FILE`` and ``privreg job schema``: a job file as privreg reads it.

``check`` validates a job file and the sub-job files it names (``core/job_schema.py``) and
prints it with every default filled in; ``schema --markdown`` prints the job-file reference
(docs/reference/job-file.md).
"""

from __future__ import annotations

import argparse
import json
import sys


def check(args: argparse.Namespace) -> None:
    """Print the validated job (JSON, defaults filled in); a bad file raises its short error."""
    from core.job_files import load_job, load_job_tree  # no Prefect: answers at once

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
