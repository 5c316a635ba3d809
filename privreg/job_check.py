"""``privreg job check FILE`` and ``privreg job schema``: a job file as privreg reads it.

``check`` validates a job file and the sub-job files it names (``core/job_schema.py``) and
prints it with every default filled in; ``schema --markdown`` prints the job-file reference
(docs/reference/job-file.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def check(args: argparse.Namespace) -> None:
    """Print the validated job (JSON, defaults filled in), then open the sources it names
    where they are (header and row count) and refuse what they lack; a bad file raises its
    short error, every source problem is one line naming party, file and column."""
    from core.job_files import load_job, load_job_tree  # no Prefect: answers at once
    from core.job_schema import JobFileError

    job = load_job(args.job_file)
    checked, models = [args.job_file], [job]
    if getattr(job, "subjobs", None) is not None:
        models = list(load_job_tree(args.job_file).values())
        checked += [f"{kind} {path}" for kind, path in job.subjobs.model_dump().items() if path]
        assert len(models) == len(checked)
    print(json.dumps(job.model_dump(mode="json"), indent=2))
    problems = [p for model in models for p in source_problems(model, args.config)]
    if problems:  # one line each, under the file's name
        raise JobFileError("\n".join([f"{args.job_file}: its sources do not fit it", *problems]))
    print(f"valid: {', '.join(checked)}; sources checked", file=sys.stderr)


def source_problems(job: Any, config_path: str | None) -> list[str]:
    """The checks every side runs after the terms are agreed, on the entries whose sources are
    here: with ``--config`` this party's own (paths read from its folder), without it every
    entry (paths read from the working folder, as ``privreg run`` reads them)."""
    from core.job_checks import entries, entry_party
    from storage.sources import sources_problems

    party, folder = None, Path.cwd()
    if config_path is not None:
        from federation.party_config import PartyConfig

        party, folder = PartyConfig.load(config_path).party, Path(config_path).resolve().parent
    here = {
        key: folder / entry.source
        for key, entry in entries(job).items()
        if party is None or entry_party(entry) == party
    }
    return sources_problems(job, here, shown_from=folder)


def schema(args: argparse.Namespace) -> None:
    """Print the job-file reference (markdown), as generated from the schema."""
    from flows.job_reference import markdown

    print(markdown(), end="")


def register_check(actions: argparse._SubParsersAction) -> None:
    """Add ``check`` and ``schema`` to the ``privreg job`` actions."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = actions.add_parser(
        "check",
        help="validate a job file and its sub-jobs, open the sources they name (header and row "
        "count) and refuse what does not fit; print the job with every default filled in",
        formatter_class=formatter,
    )
    parser.add_argument("job_file", help="the job file (JSON)")
    parser.add_argument(
        "--config",
        default=None,
        help="this party's party.toml: check only its own sources, read from its folder "
        "(default: every party's, read from the working folder)",
    )
    parser.set_defaults(handler=check)
    parser = actions.add_parser(
        "schema", help="print the job-file reference", formatter_class=formatter
    )
    parser.add_argument(
        "--markdown", action="store_true", default=True, help="as markdown (the only format)"
    )
    parser.set_defaults(handler=schema)
