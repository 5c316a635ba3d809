"""A job's terms: what every party of a job run must hold alike, and one digest of them.

Parties "agree" on a job by exchanging these terms before any data moves: every option of
every stage, the parties and their roles, key sizes, epsilon and delta, thresholds. What each
organisation keeps to itself is left out: the paths of its source file and of its database
(its own folder's layout), which differ between organisations by design.

Plain functions, no Prefect: the pipeline flow exchanges the terms over the channel and
refuses a peer whose terms differ, naming every differing option and both values.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
"""privreg's wire protocol, part of every job's terms: bumped whenever a protocol's messages
change so that a party of an older release cannot follow them. Parties of different versions
are then refused at agreement, naming both versions, rather than left waiting for a message
the other side no longer sends. (Terms without it come from a release before it existed.)"""

PRIVATE_FIELDS = (("source",), ("table", "database"))
"""Per-party entries that are an organisation's own business: paths inside its folder."""


@dataclass(frozen=True)
class Difference:
    """One option whose value differs between this party's terms and a peer's."""

    option: str
    mine: Any
    theirs: Any

    def describe(self, me: str, peer: str) -> str:
        return f"{self.option}: {me} has {_show(self.mine)}, {peer} has {_show(self.theirs)}"


_ABSENT = object()


def _show(value: Any) -> str:
    return "(not set)" if value is _ABSENT else json.dumps(value, sort_keys=True)


def job_terms(kind: str, spec: dict[str, Any], run: str | None) -> dict[str, Any]:
    """The terms of one job run: the job file without each party's private paths.

    ``kind`` is "main" or a sub-job's name; a main job's sub-job file names are dropped too
    (each sub-job is agreed on its own, among its own parties)."""
    terms = json.loads(json.dumps(spec))  # a deep copy of plain JSON values
    terms.pop("subjobs", None)
    terms.pop("description", None)
    for entry in terms.get("parties", {}).values():
        for path in PRIVATE_FIELDS:
            holder = entry
            for step in path[:-1]:
                holder = holder.get(step, {})
            holder.pop(path[-1], None)
    return {"protocol": PROTOCOL_VERSION, "kind": kind, "run": run or "", "job": terms}


def protocol_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why two parties' terms cannot be compared option by option: they come from releases
    that speak different protocol versions (None when the versions are equal)."""
    if theirs.get("protocol") == mine.get("protocol"):
        return None
    heard = theirs.get("protocol")
    version = "a release before protocol versions" if heard is None else f"protocol {heard}"
    return (
        f"it speaks {version}, this party protocol {mine.get('protocol')}: run the same privreg "
        "release (or one of the same protocol version) at every party"
    )


def digest(terms: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``terms`` (sorted keys, no spaces)."""
    canonical = json.dumps(terms, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def differences(mine: Any, theirs: Any, prefix: str = "") -> list[Difference]:
    """Every leaf option (dotted path) whose value differs, in sorted order."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        found: list[Difference] = []
        for key in sorted(set(mine) | set(theirs)):
            where = f"{prefix}.{key}" if prefix else str(key)
            found += differences(mine.get(key, _ABSENT), theirs.get(key, _ABSENT), where)
        return found
    if mine == theirs and type(mine) is type(theirs):
        return []
    return [Difference(prefix or "(terms)", mine, theirs)]
