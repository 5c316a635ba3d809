"""Many secure sums of one job at one key agreement (:mod:`core.secagg.multiround`), per holder.

Why a module of its own: :mod:`tasks.secure_sum` runs one four-stage session (fresh keys, share
exchange) per sum, which is what one-off sums (pooled statistics, sparse LDA) need; a training
job sums once per round and must not pay key agreement every time. Here each holder keeps one
record per job in its own store, sealed under the job's key file (:mod:`storage.secrets`):
its multi-round state (private key, pair secrets, the round it masked and the request it
answered) and what it sent from it. A step computes, stores the new record, and only then
sends; a retry (or a process restarted after kill -9) finds the record and re-sends the same
bytes, so no mask covers two inputs and no second, different unmask request is answered.

Messages (``round`` is the training round; every kind is plain, the same on a re-run):

=========================  ====================================  ===========================
kind                        sender -> receiver                    when
=========================  ====================================  ===========================
``secagg_job_keys``         party -> coordinator                  once per job (round 0)
``round`` (the call)        coordinator -> every party            each round: active + keys
``secagg_masked``           party -> coordinator                  each round
``secagg_unmask_request``   coordinator -> each sender            each round
``secagg_masked_relay``     coordinator -> each sender            with the requests
``secagg_view``             sender -> coordinator                 on its request
``secagg_view_relay``       coordinator -> each sender            before any answer
``secagg_unmask_response``  sender -> coordinator                 each round
``secagg_unmask_response_   coordinator -> each sender            before the model
relay``
``rejoin``                  left-out party -> coordinator         with its new keys (re-key)
=========================  ====================================  ===========================

The view exchange is Bonawitz et al.'s ConsistencyCheck (CCS 2017, round 3;
:mod:`core.secagg.multiround`, point 4): each sender signs the survivor and dropped sets its
request states (the channel signs every message with its sender's certificate) and the
coordinator relays every view with its proof; a sender answers only once at least the
quorum of views it holds, each checked as its signer's, equal its own. On the shared folder
of a local run the folder is trusted (no proofs): each relayed view must equal the original
there. The terms a hospital agreed (parties, threshold, stage timeout) are stored when it
joins, from its own options, and a call that states others is refused, naming the
coordinator (:func:`party_state`).

The relays let every party that answered unmask the round's sum itself and check the
coordinator's announcement (:func:`party_sum`). A relay is one message carrying every
sender's original message with that sender's proof (:meth:`PartyEndpoint.relay`): a party
checks each entry as its sender's, so the coordinator can drop, alter, swap or replay none
unnoticed, as when each party sent its peers a copy. Why through the coordinator: with n
parties a copy to each peer cost every party 2(n - 1) fetches a round (~3 ms of CPU each);
a relay costs it two.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
from prefect.runtime import flow_run

from core.secagg import multiround as mr
from core.secagg import wire
from core.secagg.errors import ProtocolViolationError
from core.secagg.fixed_point import DEFAULT_SCALE_BITS, decode
from core.secagg.graph import choose_parameters
from federation.channel import PartyEndpoint, RelayError
from federation.watchers import in_context
from storage.artifacts import Artifact
from storage.party_store import PartyStore
from storage.secrets import SealedArtifacts
from tasks.secure_sum import collect, receivers

COORDINATOR = "coordinator"
JOB_KEYS, MASKED, REQUEST, RESPONSE, REJOIN = (
    "secagg_job_keys",
    "secagg_masked",
    "secagg_unmask_request",
    "secagg_unmask_response",
    "rejoin",
)
VIEW = "secagg_view"
MASKED_RELAY, RESPONSE_RELAY = f"{MASKED}_relay", f"{RESPONSE}_relay"
VIEW_RELAY = f"{VIEW}_relay"
_RELAY_OF = {MASKED: MASKED_RELAY, RESPONSE: RESPONSE_RELAY, VIEW: VIEW_RELAY}

T = TypeVar("T")


@functools.lru_cache(maxsize=16)
def _config(
    job_id: str, parties: tuple[str, ...], threshold: int, dimension: int, scale_bits: int
) -> mr.JobConfig:
    params = choose_parameters(len(parties))
    if params.degree >= len(parties) - 1:  # complete graph: the job's own threshold holds
        params = replace(params, threshold=threshold)
    return mr.new_job(
        job_id, parties, dimension, min_senders=threshold, parameters=params, scale_bits=scale_bits
    )


@dataclass(frozen=True)
class RoundsJob:
    """What every holder of a job agrees on before its first round (small, non-secret)."""

    protocol: str  # namespaces the holders' records, e.g. "horizontal"
    job_id: str
    parties: tuple[str, ...]
    threshold: int  # fewest senders a sum may have
    dimension: int
    scale_bits: int = DEFAULT_SCALE_BITS
    stage_timeout: float = 60.0  # seconds a stage waits (the coordinator's view stage too)

    def terms(self) -> dict[str, Any]:
        """What a hospital agrees to from its own options and compares every call with."""
        return {
            "parties": list(self.parties),
            "threshold": self.threshold,
            "stage_timeout": float(self.stage_timeout),
        }

    def config(self) -> mr.JobConfig:
        """The job's SecAgg+ configuration: the same at every holder (graph from the job id);
        with a complete graph each self-mask needs ``threshold`` of its holders."""
        return _config(self.job_id, self.parties, self.threshold, self.dimension, self.scale_bits)

    @property
    def scope(self) -> str:
        """The job key file the records are sealed under (shredded at the job's end)."""
        return f"{self.protocol}/{self.job_id}/rounds"

    def record_key(self, who: str) -> str:
        return f"{self.scope}/{who}"


def _records(store: PartyStore, job: RoundsJob) -> SealedArtifacts:
    return SealedArtifacts(store, job.scope)


def load_record(store: PartyStore, job: RoundsJob, who: str, con: Any = None) -> dict[str, Any]:
    """This holder's record of the job ({} before its first step)."""
    return _records(store, job).get(job.record_key(who), {}, con=con) or {}


def save_record(
    store: PartyStore,
    job: RoundsJob,
    who: str,
    record: dict[str, Any],
    con: Any,
    also: Sequence[Artifact] = (),
) -> None:
    """Store the holder's record (sealed), with ``also`` (e.g. the round's checkpoint) in the
    same statement."""
    records = _records(store, job)
    records.artifacts.put_many([records.item(job.record_key(who), record), *also], con=con)


def forget_job(store: PartyStore, job: RoundsJob) -> None:
    """At the job's end: shred the key the records are sealed under (and drop them)."""
    _SEEN.pop(_seen_key(store, job), None)
    records = _records(store, job)
    with store.transaction() as con:
        records.artifacts.delete_prefix(job.scope + "/", con=con)
    records.destroy()


# ---------------------------------------------------------------------------------------------
# Party side


def party_state(record: dict[str, Any], job: RoundsJob | None = None) -> mr.JobPartyState:
    """The stored state; with ``job``, under the job's configuration as the coordinator's call
    states it, once that call is checked against the terms this party agreed when it joined
    (its own options: parties, threshold, stage timeout). Why: the threshold sets how many
    shares rebuild a self-mask and how many signed views a party needs before it answers; a
    coordinator that lowered it, or the stage timeout, is refused, named."""
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
    """Once per job: fresh keys; the public half to the coordinator, with ``round_`` as the
    first round this party joins (a retry, or a restart, re-sends the same message).

    ``agreed``: ``job`` carries this party's own terms (its options: parties, threshold,
    stage timeout); they are stored and every later call must state them (:func:`party_state`).
    Without it only the configuration is fixed once the party has masked a round."""
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
    """Mask ``vector`` for the started round, store, then send it to the coordinator (who
    relays it to the other senders); a retry re-sends the stored message (a round is masked
    once). Returns the stored record.

    ``guard(con)`` runs in the same transaction before masking (e.g. one contribution per
    model point) and may refuse; the artifacts it returns are stored with the record.
    """
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
            state, message = mr.mask_round(state, vector)
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
    """Sign this party's view of the round's request (the survivor and dropped sets) and send
    it to the coordinator, which relays every sender's view to every sender (ConsistencyCheck,
    :func:`core.secagg.multiround.sign_view`); reveals nothing. Returns the new record.

    One view a round: a different request for the round is refused. With ``record`` nothing
    is stored here (as :func:`party_answer` says why); a retry re-sends the same bytes."""
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
    """``step`` applied to the party's state: to ``record`` where the caller holds it (and
    stores it with the round's checkpoint), else to the stored record in one transaction,
    saved when the state changed. Returns the new record and what the step returned."""
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
    """Answer the round's unmask request (once: an identical retry gets the same answer), but
    only after the consistency check: it signs its view (:func:`party_view`, unless done)
    and waits for the coordinator's relay of the senders' signed views (:func:`party_views`).
    Returns the new record.

    With ``record`` (the one :func:`party_mask` just stored, held by the same task) nothing is
    read or written here: the caller stores the returned record with the round's checkpoint.
    That is safe: until then the stored state is "masked, not answered", and a restarted
    party can only be asked the same request again (the channel keeps one message under a
    round's key and refuses other bytes), which it signs and answers with the same bytes
    (signing and answering are deterministic given the state and the request)."""
    request = _request(request_plain, endpoint.party, round_)
    held = record is not None
    record = party_view(store, job, endpoint, round_, request_plain, record)
    views = party_views(job, endpoint, round_, 2 * job.stage_timeout)
    record, response = _advance(
        store, job, endpoint.party, record if held else None,
        lambda st: mr.answer_unmask(st, request, views),
    )  # fmt: skip
    plain = wire.response_to_plain(response)
    endpoint.send(COORDINATOR, RESPONSE, plain, round=round_)
    return record


def party_views(
    job: RoundsJob, endpoint: PartyEndpoint, round_: int, timeout: float
) -> dict[str, mr.SurvivorView]:
    """The senders' signed views of the round from the coordinator's relay, each checked as
    its signer's (over mTLS its certificate's signature; on a shared folder the original);
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


def prefetch(endpoint: PartyEndpoint, kind: str, round_: int, timeout: float) -> None:
    """Start fetching the coordinator's relay ``kind`` of the round in the background, a wait
    that returns when it arrives (or after ``timeout`` seconds); returns at once.

    Why: a party checks the round's sum from the relays once the model arrives; fetching them
    while the coordinator is still collecting and unmasking takes them off the round's
    critical path (a fetched message is kept and read locally later; a check that asks for
    one still being fetched waits for that fetch). On one shared folder there is nothing to
    fetch."""
    if endpoint.channel.transport.party is not None:
        receivers().submit(in_context(_fetch_quietly), endpoint, COORDINATOR, kind, round_, timeout)


def _fetch_quietly(
    endpoint: PartyEndpoint, peer: str, kind: str, round_: int, timeout: float
) -> None:
    with contextlib.suppress(Exception):  # the round's own wait for it reports any failure
        endpoint.receive(peer, kind, round=round_, timeout=timeout)


def _relayed(
    endpoint: PartyEndpoint, kind: str, senders: Sequence[str], round_: int, deadline: float
) -> dict[str, Any]:
    """The senders' ``kind`` messages from the coordinator's relay, each checked as its
    sender's; the coordinator's sum is refused, naming the sender, if one is not."""
    try:
        return endpoint.receive_relayed(
            COORDINATOR,
            _RELAY_OF[kind],
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
    """The round's sum as this party unmasks it itself from its peers' messages (None if it
    did not answer this round's request: it then has nothing to check).

    Why: otherwise a coordinator could announce any sum (e.g. one that barely moves the
    model, so that a later round with one party claimed dropped reveals that party's update).
    It runs the coordinator's own steps on the peers' masked inputs and answers, as the
    coordinator relayed them, each checked as its sender's (:func:`_relayed`); it learns the
    sum (the coordinator's view), no more.
    """
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


# ---------------------------------------------------------------------------------------------
# Coordinator side


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
    """Keep the coordinator's record as last committed, for this flow run only.

    Why: the coordinator reads its state at the start of every round, and an opening of its
    database is a round's largest fixed cost; only its own process writes that record, and a
    re-run (a new flow run) reads it afresh. Call only after the writing transaction
    committed. It holds no secret (public keys, commitments, who sent)."""
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
    """Add the round's masked inputs and send each sender its unmask request, then relay the
    senders' signed views (:func:`coordinator_relay_views`; ``views=False`` leaves that to
    the caller, e.g. a test driving every side in one thread); returns the senders and the
    dropped. Stored before sending: a restarted coordinator re-sends the
    same requests (never different ones, which the parties would refuse)."""
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


def coordinator_relay_views(
    store: PartyStore, job: RoundsJob, endpoint: PartyEndpoint, round_: int
) -> list[str]:
    """The consistency round's relay (Bonawitz et al. 2017, round 3): wait up to the stage
    timeout for every sender's signed view, check each is the one this coordinator gave
    (:func:`core.secagg.multiround.collect_views`), and relay all of them, with their
    proofs, to every sender. Fewer than the quorum fail the round here, naming the missing;
    nothing was revealed. A re-send is a no-op. Returns who signed."""
    state = coordinator_view(store, job)
    if not (state.round == round_ and state.stage == "unmasking"):
        raise ProtocolViolationError(
            f"coordinator: round {round_} of job {job.job_id} has no unmask requests out "
            f"(at round {state.round}, {state.stage})"
        )
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
    """Before the round's model: relay the answers it was unmasked with to every sender, so
    each that answered can check the sum (:func:`party_sum`); a re-send is a no-op."""
    endpoint.relay(senders, RESPONSE_RELAY, RESPONSE, responders, round=round_)


def coordinator_unmask(
    store: PartyStore, job: RoundsJob, round_: int, responses: Mapping[str, Any], con: Any
) -> RoundSum:
    """The round's exact sum from the answers, read in ``con`` (the caller's transaction,
    which commits the round). The caller stores ``record``, the new state, in that same
    transaction (:func:`save_record`, with the round's checkpoint in one statement)."""
    record = load_record(store, job, COORDINATOR, con)
    state = coordinator_state(record, job)
    if not (state.round == round_ and state.stage == "unmasking"):
        raise ProtocolViolationError(
            f"coordinator: round {round_} of job {job.job_id} is not being unmasked "
            f"(at round {state.round}, {state.stage})"
        )
    senders = list(state.senders)
    answers = [wire.response_from_plain(m, p) for p, m in responses.items()]
    state, result = mr.unmask(state, answers)
    record = {**record, "state": wire.coordinator_state_to_plain(state), "requests": {}}
    total = decode(result.ring_sum, job.scale_bits)
    return RoundSum(total, senders, sorted(responses), record)
