"""A local run of a job of hospitals and a coordinator (horizontal LR, sparse LDA): every side
flow at once in this process (:mod:`flows.local_run`), a hospital's failure a dropout."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core import secagg
from federation.workspace import derive_job_id
from flows.local_run import LocalJob, LocalSide, run_locally
from storage.descriptor import TableRef
from tasks.secure_sum import COORDINATOR, REFUSALS


def hospital_names(parties: Sequence[str]) -> list[str]:
    """Two or more distinct hospitals, none of them named as the coordinator."""
    names = list(parties)
    if len(names) < 2 or len(set(names)) != len(names) or COORDINATOR in names:
        raise ValueError(
            f"need at least 2 distinct party names, none of them {COORDINATOR!r}; got {names}"
        )
    return names


def hospital_tables(parties: list[dict[str, Any]]) -> list[TableRef]:
    """Every hospital's table (a local run's): distinct hospitals, each with its own database
    file and a label column."""
    refs = [TableRef.from_dict(p) for p in parties]
    hospital_names([r.party for r in refs])
    if len({r.path.resolve() for r in refs}) != len(refs):
        raise ValueError("every party needs its own database file")
    for ref in refs:
        if ref.label_column is None:
            raise ValueError(f"party {ref.party!r}: the descriptor names no label_column")
    return refs


def local_job_id(
    protocol: str, refs: list[TableRef], digests: list[str], shaping: dict[str, Any]
) -> str:
    """A local run's job id: its tables' salted digests (not where their databases are) and
    the options that shape the result, so a re-run with unchanged inputs resumes its job."""
    described = [
        {**ref.to_dict(), "database": None, "digest": digest}
        for ref, digest in zip(refs, digests, strict=True)
    ]
    return derive_job_id(protocol, {"parties": described, **shaping})


def own_table(own: dict[str, Any], names: list[str]) -> TableRef:
    """A hospital's own table, if it names a label column and the hospital is one of the
    job's."""
    ref = TableRef.from_dict(own)
    if ref.party not in names or ref.label_column is None:
        raise ValueError(
            f"party {ref.party!r}: its table must name a label_column and the party must be "
            f"one of {names}"
        )
    return ref


def agreed_threshold(threshold: int | None, names: list[str]) -> int:
    """The fewest hospitals a sum may have (default: a strict majority); an unsafe one is
    refused before any side does anything."""
    threshold = threshold or secagg.default_threshold(len(names))
    secagg.new_session("option-check", names, threshold, 1)
    return threshold


def run_hospitals(
    job_id: str,
    workspace: str | None,
    coordinator: Callable[[], Any],
    hospitals: Mapping[str, Callable[[], Any]],
) -> tuple[Any, dict[str, Any]]:
    """Every side of ``job_id`` at once; returns the coordinator's result and each hospital's
    (a dropped hospital's exception). Raises a hospital's refusal (a protocol violation it
    detected, a budget refusal) first, the cause, not the coordinator's later report of a
    missing hospital; else the run's own failure."""
    refusals: dict[str, BaseException] = {}

    def side(party: str, run: Callable[[], Any]) -> LocalSide:
        def refusing() -> Any:
            try:
                return run()
            except REFUSALS as error:
                refusals.setdefault(party, error)
                raise

        return LocalSide(party, refusing)

    sides = [side(COORDINATOR, coordinator), *(side(p, run) for p, run in hospitals.items())]
    job = LocalJob(sides, workspace, job=job_id, tolerated=tuple(hospitals))
    try:
        results = run_locally(job)
    except Exception as error:
        if refusals:
            raise next(iter(refusals.values())) from error
        raise
    if refusals:
        raise next(iter(refusals.values()))
    return results[COORDINATOR], {party: results[party] for party in hospitals}
