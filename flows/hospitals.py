"""A local run of a job of hospitals and a coordinator (horizontal LR, sparse LDA).

The protocol's only code is its side flows; this runs them at once in this process
(:mod:`flows.local_run`), each hospital a party whose failure is a dropout the protocol
survives while its threshold holds. One failure is not a dropout: a hospital that *refuses*
(a protocol violation it detected, a budget refusal) stops the run with its own error, as
the person who started every side must read that first, not the coordinator's report of a
missing hospital that follows it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flows.local_run import LocalJob, LocalSide, run_locally
from tasks.secure_sum import COORDINATOR, REFUSALS


def run_hospitals(
    job_id: str,
    workspace: str | None,
    coordinator: Callable[[], Any],
    hospitals: Mapping[str, Callable[[], Any]],
) -> tuple[Any, dict[str, Any]]:
    """Every side of ``job_id`` at once; returns the coordinator's result and each hospital's
    (a dropped hospital's exception). Raises a hospital's refusal first, else the run's own
    failure."""
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
