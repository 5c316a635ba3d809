"""Flow ``start_job``: one organisation starts a job run at every organisation.

    initiator                           each peer's service (``privreg party serve``)
    propose(job file, run) ───────────▶ standing policy: accept_from ─▶ starts its own side
    pipeline_party(job file, run)  ◀══▶ pipeline_party(job file, run, proposed_by=initiator)
                                         (terms agreed, policy checked, approval if manual)

More: docs/federation.md (how the parties run a job, and why).
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from federation.status import Federation, Proposal, ProposalRefusedError
from federation.transport_grpc import transport_for
from flows.pipeline_party import PipelineResult, _this_party, pipeline_party, read_jobs


def _run_name() -> str:
    scheduled = flow_run.scheduled_start_time
    moment = scheduled.timestamp() if scheduled is not None else time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(moment))


@flow(name="start_job")
def start_job(job_file: str = "jobs/demo.json", run: str = "") -> PipelineResult:
    """Propose a run of ``job_file`` to this party's peers, then run this party's side.

    Args:
        job_file: The job file, read from this organisation's folder (each peer reads its
            own copy at the same path; their terms are compared before anything moves).
        run: The run's name ("" for the time the run was scheduled for, UTC).
    """
    config, folder = _this_party()
    run = run or _run_name()
    jobs = read_jobs(job_file, config, folder, run)
    mine = [job for job in jobs if config.party in job.participants()]
    peers = sorted({p for job in mine for p in job.participants()} - {config.party})
    transport, logger = transport_for(config), get_run_logger()
    for peer in peers:
        try:
            logger.info("%s", transport.propose(peer, Proposal(job_file, run)))
        except ProposalRefusedError as refusal:
            for job in mine:  # peers that already started hear it and end their sides
                Federation(transport, job.run_key(), config.party, tuple(job.participants())).fail(
                    f"the run was refused: {refusal}"
                )
            raise
    return pipeline_party(job_file, run)
