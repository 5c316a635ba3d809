"""A party's side of many secure sums at one key agreement (:mod:`tasks.secure_rounds`): join,
mask, sign its view, answer, re-key when left out, and check the announced sum."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from core.secagg import multiround as mr
from core.secagg import wire
from core.secagg.errors import ProtocolViolationError
from core.secagg.fixed_point import decode
from federation.channel import PartyEndpoint, RelayError
from storage.artifacts import Artifact
from storage.party_store import PartyStore
from tasks.secure_rounds import (
    JOB_KEYS,
    MASKED,
    REJOIN,
    RELAY_OF,
    RESPONSE,
    VIEW,
    VIEW_RELAY,
    RoundsJob,
    load_record,
    save_record,
)
from tasks.secure_sum import COORDINATOR

T = TypeVar("T")


def party_state(record: dict[str, Any], job: RoundsJob | None = None) -> mr.JobPartyState:
    """The stored state; with ``job``, under the configuration the coordinator's call states,
    if it matches the terms this party joined with (else refused, naming what differs)."""
    state = wire.party_state_from_plain(record["state"])
    if job is None:
        return state
    _require_terms(record, job, state.party)
    if state.config == job.config():
        return state
    if state.last_masked >= 0:
        raise ProtocolViolationError(
            f"party {state.party!r}: the coordinator's call changes the terms of job "
            f"{job.job_id} (threshold or dimension) after the first round; refused"
        )
    return replace(state, config=job.config())


def _require_terms(record: dict[str, Any], job: RoundsJob, party: str) -> None:
    agreed = record.get("terms")
    if agreed is None:  # a record from before terms were stored: the config check decides
        return
    stated = job.terms()
    differ = [f"{k} {stated[k]!r}, not the agreed {agreed[k]!r}" for k in agreed
              if stated.get(k) != agreed[k]]  # fmt: skip
    if differ:
        raise ProtocolViolationError(
            f"party {party!r}: the coordinator's call for job {job.job_id} states "
            f"{'; '.join(differ)} (this party's own options); refused"
        )


def party_join(
    store: PartyStore, job: RoundsJob, endpoint: PartyEndpoint, round_: int, agreed: bool = False
) -> None:
    """Once per job: fresh keys, the public half sent under ``round_`` (a retry re-sends it);
    ``agreed``: ``job`` holds this party's own terms, which every call must state."""
    party = endpoint.party
    with store.transaction() as con:
        record = load_record(store, job, party, con)
        if not record:
            state, ad = mr.join(job.config(), party)
            keys = wire.advertisement_to_plain(ad)
            record = {"state": wire.party_state_to_plain(state), "keys": keys}
            record["first_keys"], record["keys_round"] = keys, round_
            if agreed:
                record["terms"] = job.terms()  # from this party's own options
            save_record(store, job, party, record, con)
    first = record["first_keys"]
    endpoint.send_once(COORDINATOR, JOB_KEYS, lambda: first, round=record["keys_round"])


def party_rejoin(store: PartyStore, job: RoundsJob, endpoint: PartyEndpoint, round_: int) -> None:
    """Left out of ``round_``: re-key once (old secrets gone), then ask back with the new keys
    on every call that still leaves it out."""
    with store.transaction() as con:
        record = load_record(store, job, endpoint.party, con)
        if not record.get("rejoining"):
            state, ad = mr.rekey(party_state(record))
            record = {
                **record,
                "state": wire.party_state_to_plain(state),
                "keys": wire.advertisement_to_plain(ad),
                "masked": None,
                "rejoining": True,
            }
            save_record(store, job, endpoint.party, record, con)
    endpoint.send_once(COORDINATOR, REJOIN, lambda: record["keys"], round=round_)


def round_start(job: RoundsJob, round_: int, call: Mapping[str, Any], party: str) -> mr.RoundStart:
    """The coordinator's call as the core's round start for ``party``."""
    keys = {p: wire.keys_from_plain(k, f"call of round {round_}") for p, k in call["keys"].items()}
    holders = set(job.config().holders(party))
    return mr.RoundStart(
        job.job_id,
        round_,
        tuple(call["active"]),
        {p: k for p, k in keys.items() if p in holders},
    )


def party_mask(
    store: PartyStore,
    job: RoundsJob,
    endpoint: PartyEndpoint,
    start: mr.RoundStart,
    vector: np.ndarray,
    guard: Callable[[Any], Sequence[Artifact]] | None = None,
) -> dict[str, Any]:
    """Mask ``vector`` (floats, or a uint64 ring vector) once for the round, store, send it;
    ``guard(con)`` may refuse first, and what it returns is stored with the returned record."""
    r, party = start.round, endpoint.party
    with store.transaction() as con:
        record = load_record(store, job, party, con)
        stored = record.get("masked")
        if stored is None or stored["round"] != r:
            state = party_state(record, job)
            if state.last_masked >= r:
                raise ProtocolViolationError(
                    f"party {party!r}: round {r} of job {job.job_id} was masked already and its "
                    "message is gone; refusing to mask it again"
                )
            marks = guard(con) if guard is not None else []
            state = mr.start_round(state, start)
            mask = mr.mask_ring_round if vector.dtype == np.uint64 else mr.mask_round
            state, message = mask(state, vector)
            stored = wire.masked_to_plain(message)
            record = {
                **record,
                "state": wire.party_state_to_plain(state),
                "masked": stored,
                "rejoining": False,
            }
            save_record(store, job, party, record, con, also=marks)
    endpoint.send(COORDINATOR, MASKED, stored, round=r)
    return record


def _request(request_plain: Any, party: str, round_: int) -> mr.UnmaskRequest:
    request = wire.request_from_plain(request_plain)
    if request.round != round_:
        raise ProtocolViolationError(
            f"party {party!r}: an unmask request for round {request.round} came as round {round_}"
        )
    return request


def party_view(
    store: PartyStore,
    job: RoundsJob,
    endpoint: PartyEndpoint,
    round_: int,
    request_plain: Any,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Sign and send this party's one view of the round's request (survivor and dropped sets)
    for the coordinator to relay; returns the new record (with ``record``: unstored)."""
    request = _request(request_plain, endpoint.party, round_)
    record, view = _advance(
        store, job, endpoint.party, record, lambda st: mr.sign_view(st, request)
    )
    endpoint.send(COORDINATOR, VIEW, wire.view_to_plain(view), round=round_)
    return record


def _advance(
    store: PartyStore,
    job: RoundsJob,
    party: str,
    record: dict[str, Any] | None,
    step: Callable[[Any], tuple[Any, T]],
) -> tuple[dict[str, Any], T]:
    """``step`` applied to ``record`` (the caller stores it), else to the stored record, saved
    when the state changed; returns the new record and what the step returned."""
    if record is not None:
        state, out = step(party_state(record, job))
        return {**record, "state": wire.party_state_to_plain(state)}, out
    with store.transaction() as con:
        record = load_record(store, job, party, con)
        before = party_state(record, job)
        state, out = step(before)
        if state != before:
            record = {**record, "state": wire.party_state_to_plain(state)}
            save_record(store, job, party, record, con)
    return record, out


def party_answer(
    store: PartyStore,
    job: RoundsJob,
    endpoint: PartyEndpoint,
    round_: int,
    request_plain: Any,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Answer the round's unmask request once, after the consistency check; returns the new
    record (with ``record``: the caller stores it, as a restart gets the same request again)."""
    request = _request(request_plain, endpoint.party, round_)
    held = record is not None
    record = party_view(store, job, endpoint, round_, request_plain, record)
    views = party_views(job, endpoint, round_, 2 * job.stage_timeout)
    record, response = _advance(
        store, job, endpoint.party, record if held else None,
        lambda st: mr.answer_unmask(st, request, views),
    )  # fmt: skip
    endpoint.send(COORDINATOR, RESPONSE, wire.response_to_plain(response), round=round_)
    return record


def party_views(
    job: RoundsJob, endpoint: PartyEndpoint, round_: int, timeout: float
) -> dict[str, mr.SurvivorView]:
    """The senders' signed views from the coordinator's relay, each checked as its signer's;
    a relay that fails the check is refused, naming the coordinator."""
    try:
        entries = endpoint.receive(COORDINATOR, VIEW_RELAY, round=round_, timeout=timeout)
        signers = sorted(entries) if isinstance(entries, dict) else []
        if not all(isinstance(s, str) and s in job.parties for s in signers):
            raise RelayError(f"it names signers {signers} outside the job's parties")
        plain = endpoint.receive_relayed(
            COORDINATOR, VIEW_RELAY, VIEW, signers, round=round_, timeout=0.0
        )
    except RelayError as error:
        raise ProtocolViolationError(
            f"party {endpoint.party!r}: the coordinator's relay of the survivor views of round "
            f"{round_} of job {job.job_id} is refused before anything is revealed: {error}"
        ) from None
    return {s: wire.view_from_plain(v, s) for s, v in plain.items()}


def _relayed(
    endpoint: PartyEndpoint, kind: str, senders: Sequence[str], round_: int, deadline: float
) -> dict[str, Any]:
    """The senders' ``kind`` messages from the relay; one not its sender's refuses the sum."""
    try:
        return endpoint.receive_relayed(
            COORDINATOR,
            RELAY_OF[kind],
            kind,
            senders,
            round=round_,
            timeout=max(deadline - time.monotonic(), 0.0),
        )
    except RelayError as error:
        raise ProtocolViolationError(
            f"party {endpoint.party!r}: {error}; refusing the coordinator's sum of round {round_}"
        ) from None


def party_sum(
    job: RoundsJob,
    endpoint: PartyEndpoint,
    record: dict[str, Any],
    call: Mapping[str, Any],
    round_: int,
    revealers: Sequence[str] | None,
    timeout: float,
) -> np.ndarray | None:
    """The round's sum as this party unmasks it from the relayed messages (None if it did not
    answer this round's request), to check the announced one (docs/protocols/horizontal-lr.md)."""
    if not record:
        return None
    party = endpoint.party
    state = party_state(record, job)
    if state.answered is None or state.answered[0].round != round_:
        return None
    request, own_response = state.answered
    own_masked = wire.masked_from_plain(record["masked"], party)
    deadline = time.monotonic() + timeout
    others = [p for p in request.senders if p != party]
    masked = _relayed(endpoint, MASKED, others, round_, deadline)
    keys = {p: wire.keys_from_plain(k) for p, k in call["keys"].items()}
    replica = mr.JobCoordinatorState(
        job.config(), keys, tuple(call["active"]), round_, "collecting"
    )
    inputs = [own_masked, *(wire.masked_from_plain(masked[p], p) for p in others)]
    replica, _ = mr.collect_inputs(replica, inputs)
    helpers = [p for p in (request.senders if revealers is None else revealers) if p != party]
    answers = _relayed(endpoint, RESPONSE, helpers, round_, deadline)
    responses = [own_response, *(wire.response_from_plain(answers[p], p) for p in helpers)]
    _, result = mr.unmask(replica, responses)
    return decode(result.ring_sum, job.scale_bits)
