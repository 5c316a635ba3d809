"""Flow ``start_job``: one organisation starts a job run at every organisation.

    initiator                           each peer's service (``privreg party serve``)
    propose(job file, run) ───────────▶ standing policy: accept_from ─▶ starts its own side
    pipeline_party(job file, run)  ◀══▶ pipeline_party(job file, run, proposed_by=initiator)
                                         (terms agreed, policy checked, approval if manual)

A restart (``privreg job resume``) proposes only to peers whose side is not running, and a
refusal is a warning: the live sides still hold the run and wait within its restart grace.

More: docs/federation.md (how the parties run a job, and why).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from federation.channel import ChannelError
from federation.status import (
    LIVE,
    Federation,
    PartyStatus,
    Proposal,
    ProposalRefusedError,
    silent_too_long,
)
from federation.transport_grpc import transport_for
from flows.pipeline_party import PartyJob, PipelineResult, _this_party, pipeline_party, read_jobs


def _run_name() -> str:
    scheduled = flow_run.scheduled_start_time
    moment = scheduled.timestamp() if scheduled is not None else time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(moment))


@flow(name="start_job")
def start_job(
    job_file: str = "jobs/demo.json", run: str = "", restart: bool = False
) -> PipelineResult:
    """Propose a run of ``job_file`` to this party's peers, then run this party's side.

    Args:
        job_file: The job file, read from this organisation's folder (each peer reads its
            own copy at the same path; their terms are compared before anything moves).
        run: The run's name ("" for the time the run was scheduled for, UTC).
        restart: Restart this party's side of a run already under way (``job resume``):
            peers whose side runs are not asked again, and a peer's refusal is a warning.
    """
    config, folder = _this_party()
    run = run or _run_name()
    jobs = read_jobs(job_file, config, folder, run)
    mine = [job for job in jobs if config.party in job.participants()]
    peers = sorted({p for job in mine for p in job.participants()} - {config.party})
    transport, logger = transport_for(config), get_run_logger()
    for peer in peers:
        if restart and _side_running(transport, mine, peer):
            logger.info("%s: its side of run %s is running; it waits for this side", peer, run)
            continue
        try:
            logger.info("%s", transport.propose(peer, Proposal(job_file, run)))
        except (ProposalRefusedError, ChannelError) as refusal:
            if restart:
                logger.warning(
                    "%s did not restart its side (%s); the run goes on if it comes back within "
                    "the job's restart grace (privreg job resume at %s)", peer, refusal, peer,
                )  # fmt: skip
                continue
            if not isinstance(refusal, ProposalRefusedError):
                raise
            for job in mine:  # peers that already started hear it and end their sides
                Federation(transport, job.run_key(), config.party, tuple(job.participants())).fail(
                    f"the run was refused: {refusal}"
                )
            raise
    return pipeline_party(job_file, run)


def _side_running(transport: Any, jobs: list[PartyJob], peer: str) -> bool:
    """Whether ``peer``'s side of the run is alive, by the rule its peers use for "down": a
    live record of one of its jobs rewritten within ``federation.status.DOWN_AFTER``."""
    now = time.time()
    for job in jobs:
        if peer not in job.participants():
            continue
        try:
            data = transport.peer_status(job.run_key(), peer)
        except ChannelError:
            return False
        if data is None:
            continue
        status = PartyStatus.from_bytes(data)
        if status.state in LIVE and not silent_too_long(status.heartbeat, now):
            return True
    return False
