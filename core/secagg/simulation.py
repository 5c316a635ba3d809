"""Many rounds of :mod:`core.secagg.multiround` for simulated parties in one process.

Why: tests and benchmarks need a job of 10 to 1,000 parties without a message bus. It calls
exactly the step functions a deployment wires to its transport, in the order they run there,
and keeps every party's and the coordinator's state between rounds (as their stores would).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from core.secagg import multiround as mr


@dataclass
class SimulatedJob:
    """Every party's state and the coordinator's, between rounds (mutable harness)."""

    config: mr.JobConfig
    parties: dict[str, mr.JobPartyState]
    coordinator: mr.JobCoordinatorState
    log: list[str] = field(default_factory=list)


def start_job(config: mr.JobConfig) -> SimulatedJob:
    """Every party joins (one key advertisement each) and the coordinator admits them."""
    states, ads = {}, []
    for party in config.parties:
        states[party], ad = mr.join(config, party)
        ads.append(ad)
    coordinator = mr.admit(mr.start_coordinator(config), ads)
    return SimulatedJob(config, states, coordinator)


def run_round(
    job: SimulatedJob,
    round_: int,
    vectors: Mapping[str, np.ndarray],
    silent_at_mask: Collection[str] = (),
    silent_at_unmask: Collection[str] = (),
) -> mr.RoundSum:
    """One round: start, masked inputs (less the silent), unmask requests, signed survivor
    views relayed to every sender, responses, sum (``silent_at_unmask`` sign no view).

    ``vectors`` are uint64 ring vectors by party; a party out of the session sends nothing.
    """
    job.coordinator, starts = mr.open_round(job.coordinator, round_)
    for party, start in starts.items():
        job.parties[party] = mr.start_round(job.parties[party], start)
    inputs = []
    for party in starts:
        if party in silent_at_mask:
            continue
        job.parties[party], message = mr.mask_ring_round(job.parties[party], vectors[party])
        inputs.append(message)
    job.coordinator, requests = mr.collect_inputs(job.coordinator, inputs)
    views = {}
    for party, request in requests.items():
        if party in silent_at_unmask:
            continue
        job.parties[party], views[party] = mr.sign_view(job.parties[party], request)
    relayed = mr.collect_views(job.coordinator, list(views.values()))
    signed = {p: views[p] for p in relayed}
    responses = []
    for party in views:
        job.parties[party], response = mr.answer_unmask(job.parties[party], requests[party], signed)
        responses.append(response)
    job.coordinator, result = mr.unmask(job.coordinator, responses)
    job.log.append(f"round {round_}: {len(result.senders)} senders")
    return result


def rejoin(job: SimulatedJob, party: str) -> None:
    """A party that was left out re-keys and is admitted again (before the next round)."""
    job.parties[party], advertisement = mr.rekey(job.parties[party])
    job.coordinator = mr.admit(job.coordinator, [advertisement])


def out_of_session(job: SimulatedJob) -> list[str]:
    """Parties the coordinator no longer counts in (dropped and not yet rejoined)."""
    return [p for p in job.config.parties if p not in job.coordinator.active]
