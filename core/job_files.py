"""Job files: the small JSON documents that hold a run's parties, tables and options.

Every reader goes through :func:`read_job` or :func:`load_job`, so a job file (from the command
line, a sub-job list or a deployment's ``job_file`` parameter) is validated in full against
``core.job_schema`` before anything is loaded or sent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.job_schema import JobFileError, validate_job


def _parse(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"job file {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise JobFileError(f"job file {path} is not valid JSON: {error}") from None


def load_job(path: str | Path, kind: str | None = None) -> Any:
    """The validated job file as its typed model (every default filled in).

    ``kind`` ("main" or a sub-job's stage key) is the kind expected; ``None`` accepts any.
    """
    return validate_job(_parse(path), path, kind)


def read_job(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    """The job file as written (a plain dict), once it has been validated in full."""
    data = _parse(path)
    validate_job(data, path, kind)
    return data


def load_job_tree(path: str | Path) -> dict[str, Any]:
    """A main job file and every sub-job file it names, each validated: kind ─▶ model.
    Sub-job paths are read as written (relative to the working folder, as the pipeline does)."""
    main = load_job(path, "main")
    jobs: dict[str, Any] = {"main": main}
    if getattr(main, "subjobs", None) is not None:
        for kind, sub_file in main.subjobs.model_dump(exclude_none=True).items():
            jobs[kind] = load_job(sub_file, kind)
    return jobs
