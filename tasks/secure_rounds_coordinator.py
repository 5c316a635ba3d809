"""The coordinator's side of many secure sums at one key agreement (:mod:`tasks.secure_rounds`):
admit keys, add the masked inputs, relay inputs, views and answers, unmask only the sum."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from prefect.runtime import flow_run

from core.secagg import multiround as mr
from core.secagg import wire
from core.secagg.errors import ProtocolViolationError
from core.secagg.fixed_point import decode
from federation.channel import PartyEndpoint
from storage.party_store import PartyStore
from tasks.secure_rounds import (
    MASKED,
    MASKED_RELAY,
    REQUEST,
    RESPONSE,
    RESPONSE_RELAY,
    VIEW,
    VIEW_RELAY,
    RoundsJob,
    forget_job,
    load_record,
    save_record,
)
from tasks.secure_sum import COORDINATOR, collect


@dataclass(frozen=True)
class RoundSum:
    """A round's decoded sum, who sent, and who answered the unmask request."""

    total: np.ndarray
    senders: list[str]
    responders: list[str]
    record: dict[str, Any]  # the coordinator's new record (:func:`remember` it once committed)


def coordinator_state(record: dict[str, Any], job: RoundsJob) -> mr.JobCoordinatorState:
    if not record:
        return mr.start_coordinator(job.config())
    return wire.coordinator_state_from_plain(record["state"])


_SEEN: dict[tuple[str | None, str, str], dict[str, Any]] = {}


def _seen_key(store: PartyStore, job: RoundsJob) -> tuple[str | None, str, str]:
    return (flow_run.get_id(), str(store.path), job.record_key(COORDINATOR))


def remember(store: PartyStore, job: RoundsJob, record: dict[str, Any]) -> None:
    """Keep the coordinator's record as last committed (no secret), for this flow run only:
    only this process writes it, and opening the database is a round's largest fixed cost."""
    if len(_SEEN) > 16:
        _SEEN.clear()
    _SEEN[_seen_key(store, job)] = record


def coordinator_view(store: PartyStore, job: RoundsJob) -> mr.JobCoordinatorState:
    """The coordinator's state as last committed (read from its store once per flow run)."""
    record = _SEEN.get(_seen_key(store, job))
    if record is None:
        return coordinator_admit(store, job, {})
    return coordinator_state(record, job)


def coordinator_admit(
    store: PartyStore, job: RoundsJob, advertisements: Mapping[str, Any]
) -> mr.JobCoordinatorState:
    """Between rounds: take the first keys of the job or a left-out party's new ones."""
    with store.transaction() as con:
        record = load_record(store, job, COORDINATOR, con)
        state = coordinator_state(record, job)
        fresh = []
        for party, plain in advertisements.items():
            ad = wire.advertisement_from_plain(plain, party)
            known = state.keys.get(party)
            if known is None or ad.keys.epoch > known.epoch:  # first keys, or a re-key
                fresh.append(ad)
        if fresh or not record:
            state = mr.admit(state, fresh)
            record = {**record, "state": wire.coordinator_state_to_plain(state)}
            save_record(store, job, COORDINATOR, record, con)
    remember(store, job, record)
    return state


def call_keys(state: mr.JobCoordinatorState) -> dict[str, Any]:
    """What a round's call carries for the protocol: the active parties and their keys."""
    return {
        "active": list(state.active),
        "keys": {p: wire.keys_to_plain(state.keys[p]) for p in state.active},
    }


def coordinator_collect(
    store: PartyStore,
    job: RoundsJob,
    endpoint: PartyEndpoint,
    round_: int,
    inputs: Mapping[str, Any],
    views: bool = True,
) -> tuple[list[str], list[str]]:
    """Add the round's masked inputs, store, then send each sender its unmask request and relay
    the signed views (``views=False``: the caller does); returns senders and dropped."""
    with store.transaction() as con:
        record = load_record(store, job, COORDINATOR, con)
        state = coordinator_state(record, job)
        if not (state.round == round_ and state.stage == "unmasking"):
            if state.stage != "idle":  # a round opened but never stored: open it again
                state = replace(state, stage="idle")
            state, _ = mr.open_round(state, round_)
            messages = [wire.masked_from_plain(m, p) for p, m in inputs.items()]
            state, requests = mr.collect_inputs(state, messages)
            record = {
                **record,
                "state": wire.coordinator_state_to_plain(state),
                "requests": {p: wire.request_to_plain(q) for p, q in requests.items()},
            }
            save_record(store, job, COORDINATOR, record, con)
    remember(store, job, record)
    endpoint.send_each(record["requests"], REQUEST, round=round_)
    senders = list(state.senders)
    endpoint.relay(senders, MASKED_RELAY, MASKED, senders, round=round_)
    if views:
        coordinator_relay_views(store, job, endpoint, round_)
    return senders, list(state.dropped)


def _unmasking(state: Any, job: RoundsJob, round_: int) -> Any:
    """``state``, if it has round ``round_``'s unmask requests out; else refused, naming it."""
    if not (state.round == round_ and state.stage == "unmasking"):
        raise ProtocolViolationError(
            f"coordinator: round {round_} of job {job.job_id} has no unmask requests out "
            f"(at round {state.round}, {state.stage})"
        )
    return state


def coordinator_relay_views(
    store: PartyStore, job: RoundsJob, endpoint: PartyEndpoint, round_: int
) -> list[str]:
    """The consistency check's relay of the senders' signed views that arrive in time (fewer
    than the quorum fail, naming the missing); returns who signed."""
    state = _unmasking(coordinator_view(store, job), job, round_)
    senders = list(state.senders)
    deadline = time.monotonic() + job.stage_timeout
    found = collect(endpoint, VIEW, senders, round_, deadline)
    views = [wire.view_from_plain(found[p], p) for p in senders if p in found]
    signed = list(mr.collect_views(state, views))
    endpoint.relay(senders, VIEW_RELAY, VIEW, signed, round=round_)
    return signed


def coordinator_relay_answers(
    endpoint: PartyEndpoint, round_: int, senders: Sequence[str], responders: Sequence[str]
) -> None:
    """Before the round's model: relay the answers it was unmasked with to every sender (for
    :func:`tasks.secure_rounds_party.party_sum`)."""
    endpoint.relay(senders, RESPONSE_RELAY, RESPONSE, responders, round=round_)


def coordinator_unmask(
    store: PartyStore, job: RoundsJob, round_: int, responses: Mapping[str, Any], con: Any
) -> RoundSum:
    """The round's exact sum from the answers, read in ``con``, the caller's transaction, which
    stores the new ``record`` with the round's checkpoint."""
    record = load_record(store, job, COORDINATOR, con)
    state = _unmasking(coordinator_state(record, job), job, round_)
    senders = list(state.senders)
    answers = [wire.response_from_plain(m, p) for p, m in responses.items()]
    state, result = mr.unmask(state, answers)
    record = {**record, "state": wire.coordinator_state_to_plain(state), "requests": {}}
    total = decode(result.ring_sum, job.scale_bits)
    return RoundSum(total, senders, sorted(responses), record)


def forget(store: PartyStore, job: RoundsJob) -> None:
    """At the job's end: :func:`tasks.secure_rounds.forget_job`, and this run's copy."""
    _SEEN.pop(_seen_key(store, job), None)
    forget_job(store, job)
