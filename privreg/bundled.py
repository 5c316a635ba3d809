"""What an installed privreg carries besides its code: its version and the demo's files.

The demo is the repository's ``jobs/demo.json``, the sub-job files it names and every party's
source. A wheel carries them as package data under ``privreg/demo_data/`` (setup.py copies
:func:`demo_files` there, the same paths as in the repository); a checkout or an editable
install reads them where they are. This module uses the standard library only: setup.py loads
it by path, in a build environment that has none of privreg's dependencies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import metadata, resources
from importlib.resources.abc import Traversable
from pathlib import Path

MAIN_JOB = "jobs/demo.json"
"""The demo's main job file, relative to the demo's folder (as every path the job names)."""

PACKAGED = "demo_data"
"""The folder of the ``privreg`` package that holds the demo in a wheel."""


def version() -> str:
    """The installed distribution's version: pyproject.toml's ``version``, the one place it is
    written (read from the install's metadata, so a wheel needs no source tree)."""
    try:
        return metadata.version("privreg")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _at(root: Traversable, relative: str) -> Traversable:
    """``root / relative`` for a path written with ``/`` (as job files write them)."""
    return root.joinpath(*relative.split("/"))


def demo_files(root: Traversable) -> list[str]:
    """Every file the demo reads, relative to ``root``: the main job file, the sub-job files
    it names and each party's source, in that order.

    Raises FileNotFoundError for one that ``root`` lacks, so a build fails rather than ship a
    demo that stops at its load stage."""
    found: dict[str, None] = {}
    pending = [MAIN_JOB]
    while pending:
        job_file = pending.pop(0)
        if job_file in found:
            continue
        if not _at(root, job_file).is_file():
            raise FileNotFoundError(f"the demo's job file {job_file} is missing from {root}")
        found[job_file] = None
        spec = json.loads(_at(root, job_file).read_text(encoding="utf-8"))
        for party, entry in spec.get("parties", {}).items():
            source = entry.get("source")
            if source is None:
                continue
            if not _at(root, source).is_file():
                raise FileNotFoundError(
                    f"{job_file}: {party}'s source {source} is missing from {root}"
                )
            found.setdefault(source, None)
        pending += [path for path in spec.get("subjobs", {}).values() if path]
    return list(found)


def demo_root() -> Traversable:
    """The folder the demo's files are read from: the wheel's package data, else the checkout
    this package was imported from (a checkout or an editable install)."""
    packaged = resources.files("privreg") / PACKAGED
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / MAIN_JOB).is_file():
        return checkout
    raise FileNotFoundError(
        f"this privreg has no demo files ({PACKAGED} is missing from the package and "
        f"{checkout} is no checkout): reinstall it from a wheel built with `make dist`"
    )


def copy_demo(target: Path) -> Iterator[tuple[str, bool]]:
    """Write the demo's files under ``target`` (same relative paths); yields each path and
    whether it was written. A file already there is kept, so edits to a copied job file
    survive a second ``privreg demo`` in the same folder."""
    root = demo_root()
    for relative in demo_files(root):
        destination = target / relative
        if destination.exists():
            yield relative, False
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(_at(root, relative).read_bytes())
        yield relative, True
