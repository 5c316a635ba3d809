"""Secure summation of one vector per party (:mod:`core.secagg`), one task per party step.

Why a module of its own: several protocols need "the sum of the parties' vectors, and only the
sum". A party's vector is read from *its own* store (an artifact its own earlier task wrote),
so it never passes through the flow or the orchestrator; only key advertisements, encrypted
shares and masked vectors cross the channel. The coordinator, a logical party with its own
store, keeps the decoded sum there. Protocols that compute their vector inside the masking
step (horizontal LR) call the plain step functions (``party_*`` / ``coordinator_*``) from
their own tasks instead.

Every step stores its new state and its outgoing message in the stepping party's artifacts
*before* sending, and a retry re-sends what was stored instead of computing again, so one
session's masks never cover two different inputs. A party also refuses to help unmask a
(job, round) a second time for a different set of senders: the difference of two such sums
would be one party's vector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from core import secagg
from storage.artifacts import ArtifactStore
from storage.channel import ChannelError, PartyEndpoint
from storage.descriptor import TableRef
from storage.ledger import BudgetError
from storage.party_store import PartyStore
from storage.workspace import channel_for, workspace_root
from tasks.policy import PARTY_STEP

COORDINATOR = "coordinator"


class RoundStateError(ValueError):
    """A holder lacks the state a step needs (e.g. a restarted session); restart the round."""


@dataclass(frozen=True)
class SumContext:
    """What every step of one secure-sum session agrees on; small and non-secret."""

    protocol: str  # namespaces the holders' artifacts, e.g. "horizontal"
    job_id: str
    round: int
    session_id: str  # fresh for every attempt: keys and masks are never reused
    parties: tuple[str, ...]
    threshold: int
    dimension: int
    workspace: str | None = None
    scale_bits: int = secagg.DEFAULT_SCALE_BITS

    def endpoint(self, party: str) -> PartyEndpoint:
        return channel_for(self.job_id, self.workspace).endpoint(party)

    def config(self) -> secagg.SessionConfig:
        return secagg.new_session(
            self.session_id, list(self.parties), self.threshold, self.dimension, self.scale_bits
        )

    @property
    def prefix(self) -> str:
        """Artifact prefix of the session records (dropped when a new session starts)."""
        return f"{self.protocol}/{self.job_id}/secagg/"

    @property
    def revealed_key(self) -> str:
        """Which senders a party helped unmask this (job, round) for; kept for the job's life."""
        return f"{self.protocol}/{self.job_id}/revealed/{self.round:07d}"

    @property
    def sum_key(self) -> str:
        """Where the coordinator keeps the decoded sum of this (job, round)."""
        return f"{self.protocol}/{self.job_id}/sum/{self.round:07d}"


def coordinator_store(workspace: str | None) -> PartyStore:
    return PartyStore(workspace_root(workspace) / "parties" / f"{COORDINATOR}.duckdb")


class SessionRecords:
    """A holder's secagg records of the current session, read and written in one transaction.

    :meth:`once` stores a step's new state with its outgoing message, and commits, before
    anything is sent; a retry gets the stored message back instead of a fresh computation.
    """

    def __init__(self, store: PartyStore, con: Any, ctx: SumContext, who: str) -> None:
        self.artifacts, self.con, self.ctx, self.who = ArtifactStore(store), con, ctx, who

    def _record(self, step: str) -> dict[str, Any] | None:
        record = self.artifacts.get(self.ctx.prefix + step, con=self.con)
        return record if record and record["session_id"] == self.ctx.session_id else None

    def state(self, step: str) -> Any:
        record = self._record(step)
        if record is None:
            raise RoundStateError(
                f"{self.who}: no {step!r} state for session {self.ctx.session_id}; "
                "restart the round"
            )
        return record["state"]

    def once(self, step: str, compute: Callable[[], tuple[Any, Any]]) -> Any:
        record = self._record(step)
        if record is None:
            state, outbox = compute()
            record = {"session_id": self.ctx.session_id, "state": state, "outbox": outbox}
            self.artifacts.put(self.ctx.prefix + step, record, "secagg-state", con=self.con)
        return record["outbox"]

    def forget_older_sessions(self) -> None:
        """Drop what an aborted attempt left behind (or this session's secrets, once done)."""
        self.artifacts.delete_prefix(self.ctx.prefix, con=self.con)


@contextmanager
def session(store: PartyStore, ctx: SumContext, who: str) -> Iterator[SessionRecords]:
    with store.transaction() as con:
        yield SessionRecords(store, con, ctx, who)


def arrived(endpoint: PartyEndpoint, ctx: SumContext, kind: str) -> list[dict[str, Any]]:
    """This session's messages of ``kind``; a party with none (or a stale one) has dropped."""
    messages = []
    for party in ctx.parties:
        try:
            message = endpoint.receive(party, kind, round=ctx.round)
        except ChannelError:
            continue
        if isinstance(message, dict) and message.get("session_id") == ctx.session_id:
            messages.append(message)
    return messages


# ---------------------------------------------------------------------------------------------
# Party steps (plain functions: a task opens the party's own store and calls one of these)


def party_advertise(store: PartyStore, ctx: SumContext, party: str) -> None:
    """Step 0: fresh key pairs for this session; public halves to the coordinator."""
    config = ctx.config()
    with session(store, ctx, party) as records:

        def start() -> tuple[Any, Any]:
            records.forget_older_sessions()
            return secagg.advertise_keys(config, party)

        message = records.once("advertise", start)
    ctx.endpoint(party).send(COORDINATOR, "secagg_keys", message, round=ctx.round)


def party_share(store: PartyStore, ctx: SumContext, party: str) -> None:
    """Step 1: Shamir shares of the mask key and self-mask seed, encrypted per peer."""
    endpoint = ctx.endpoint(party)
    directory = endpoint.receive(COORDINATOR, "secagg_directory", round=ctx.round)
    with session(store, ctx, party) as records:
        message = records.once(
            "share", lambda: secagg.share_keys(records.state("advertise"), directory)
        )
    endpoint.send(COORDINATOR, "secagg_shares", message, round=ctx.round)


def party_mask(store: PartyStore, ctx: SumContext, party: str, vector: np.ndarray) -> None:
    """Step 2: send ``vector`` masked (a retry re-sends the stored masked message)."""
    endpoint = ctx.endpoint(party)
    delivery = endpoint.receive(COORDINATOR, "secagg_shares", round=ctx.round)
    with session(store, ctx, party) as records:
        message = records.once(
            "mask", lambda: secagg.mask_input(records.state("share"), delivery, vector)
        )
    endpoint.send(COORDINATOR, "secagg_masked", message, round=ctx.round)


def party_reveal(store: PartyStore, ctx: SumContext, party: str) -> None:
    """Step 3: shares that unmask the sum of the senders (and only that).

    A (job, round) re-run after an abort sums the same inputs again, so a party refuses to
    help unmask it for a *different* set of senders: the difference of two such sums would
    be the plain vector of the parties in one set and not the other.
    """
    endpoint = ctx.endpoint(party)
    request = endpoint.receive(COORDINATOR, "secagg_unmask_request", round=ctx.round)
    senders = sorted(request["input_senders"])
    with session(store, ctx, party) as records:

        def reveal() -> tuple[Any, Any]:
            before = records.artifacts.get(ctx.revealed_key, con=records.con)
            if before is not None and sorted(before) != senders:
                raise secagg.ProtocolViolationError(
                    f"party {party!r}: round {ctx.round} of job {ctx.job_id} was already "
                    f"unmasked for senders {sorted(before)}; refusing to unmask it for "
                    f"{senders} (the difference would reveal single inputs). Wait for those "
                    "parties or start a new job."
                )
            records.artifacts.put(ctx.revealed_key, senders, "secagg-revealed", con=records.con)
            return secagg.reveal_shares(records.state("mask"), request)

        response = records.once("reveal", reveal)
    endpoint.send(COORDINATOR, "secagg_unmask_response", response, round=ctx.round)


def forget_session(store: PartyStore, ctx: SumContext, who: str) -> None:
    """Drop this session's secrets once the sum is out (the revealed-senders record stays)."""
    with session(store, ctx, who) as records:
        records.forget_older_sessions()


# ---------------------------------------------------------------------------------------------
# Coordinator steps: it relays, tracks who dropped, and unmasks only the sum


def coordinator_directory(store: PartyStore, ctx: SumContext) -> list[str]:
    """Step 0: the directory of public keys, to every advertiser; returns the advertisers."""
    endpoint = ctx.endpoint(COORDINATOR)
    advertisements = arrived(endpoint, ctx, "secagg_keys")
    with session(store, ctx, COORDINATOR) as records:

        def directory() -> tuple[Any, Any]:
            records.forget_older_sessions()
            return secagg.collect_key_advertisements(
                secagg.start_coordinator(ctx.config()), advertisements
            )

        message = records.once("directory", directory)
    for party in message["public_keys"]:
        endpoint.send(party, "secagg_directory", message, round=ctx.round)
    return list(message["public_keys"])


def coordinator_route(store: PartyStore, ctx: SumContext) -> list[str]:
    """Step 1: forward the encrypted shares it cannot open; returns the share senders."""
    endpoint = ctx.endpoint(COORDINATOR)
    messages = arrived(endpoint, ctx, "secagg_shares")
    with session(store, ctx, COORDINATOR) as records:
        deliveries = records.once(
            "route", lambda: secagg.route_encrypted_shares(records.state("directory"), messages)
        )
    for party, delivery in deliveries.items():
        endpoint.send(party, "secagg_shares", delivery, round=ctx.round)
    return list(deliveries)


def coordinator_collect(store: PartyStore, ctx: SumContext) -> list[str]:
    """Step 2: add the masked inputs; ask the senders to help unmask the sum."""
    endpoint = ctx.endpoint(COORDINATOR)
    messages = arrived(endpoint, ctx, "secagg_masked")
    with session(store, ctx, COORDINATOR) as records:
        request = records.once(
            "collect", lambda: secagg.collect_masked_inputs(records.state("route"), messages)
        )
    for party in request["input_senders"]:
        endpoint.send(party, "secagg_unmask_request", request, round=ctx.round)
    return list(request["input_senders"])


def coordinator_reconstruct(store: PartyStore, ctx: SumContext) -> tuple[np.ndarray, list[str]]:
    """Step 3: the decoded sum of the input senders, and who they are (deterministic)."""
    with session(store, ctx, COORDINATOR) as records:
        state = records.state("collect")
    responses = arrived(ctx.endpoint(COORDINATOR), ctx, "secagg_unmask_response")
    _, aggregate = secagg.reconstruct_sum(state, responses)
    total = secagg.decode(aggregate["ring_sum"], state["config"]["scale_bits"])
    return total, list(aggregate["input_senders"])


# ---------------------------------------------------------------------------------------------
# Tasks: a vector that each party stored in its own store, summed at the coordinator


@task(
    name="secagg-advertise-keys",
    task_run_name="round {ctx.round}: {ref.party} advertise keys",
    **PARTY_STEP,
)
def advertise_keys(ref: TableRef, ctx: SumContext) -> None:
    party_advertise(PartyStore.of(ref), ctx, ref.party)


@task(
    name="secagg-share-keys",
    task_run_name="round {ctx.round}: {ref.party} share keys",
    **PARTY_STEP,
)
def share_keys(ref: TableRef, ctx: SumContext) -> None:
    party_share(PartyStore.of(ref), ctx, ref.party)


@task(
    name="secagg-mask-stored-input",
    task_run_name="round {ctx.round}: {ref.party} mask {input_key}",
    **PARTY_STEP,
)
def mask_stored_input(ref: TableRef, ctx: SumContext, input_key: str) -> None:
    """Mask the vector this party stored under ``input_key`` in its own store."""
    store = PartyStore.of(ref)
    vector = ArtifactStore(store).get(input_key)
    if not isinstance(vector, np.ndarray) or vector.shape != (ctx.dimension,):
        raise RoundStateError(
            f"{ref.party}: no vector of length {ctx.dimension} stored under {input_key!r}"
        )
    party_mask(store, ctx, ref.party, vector)


@task(
    name="secagg-reveal-shares",
    task_run_name="round {ctx.round}: {ref.party} reveal shares",
    **PARTY_STEP,
)
def reveal_shares(ref: TableRef, ctx: SumContext) -> None:
    party_reveal(PartyStore.of(ref), ctx, ref.party)


@task(
    name="secagg-forget-session",
    task_run_name="round {ctx.round}: {ref.party} forget session",
    **PARTY_STEP,
)
def forget_party_session(ref: TableRef, ctx: SumContext) -> None:
    forget_session(PartyStore.of(ref), ctx, ref.party)


@task(
    name="secagg-key-directory",
    task_run_name="round {ctx.round}: coordinator publish keys",
    **PARTY_STEP,
)
def publish_key_directory(ctx: SumContext) -> list[str]:
    return coordinator_directory(coordinator_store(ctx.workspace), ctx)


@task(
    name="secagg-route-shares",
    task_run_name="round {ctx.round}: coordinator route shares",
    **PARTY_STEP,
)
def route_shares(ctx: SumContext) -> list[str]:
    return coordinator_route(coordinator_store(ctx.workspace), ctx)


@task(
    name="secagg-collect-masked",
    task_run_name="round {ctx.round}: coordinator add masked",
    **PARTY_STEP,
)
def collect_masked(ctx: SumContext) -> list[str]:
    return coordinator_collect(coordinator_store(ctx.workspace), ctx)


@task(
    name="secagg-unmask-sum",
    task_run_name="round {ctx.round}: coordinator unmask sum",
    **PARTY_STEP,
)
def unmask_sum(ctx: SumContext) -> list[str]:
    """Store the decoded sum under ``ctx.sum_key`` in the coordinator's store; return senders.

    The sum and the dropping of the session's secrets are one transaction; a retry after it
    returns what was stored.
    """
    store = coordinator_store(ctx.workspace)
    artifacts = ArtifactStore(store)
    stored = artifacts.get(ctx.sum_key)
    if stored is not None and stored["session_id"] == ctx.session_id:
        return list(stored["senders"])
    total, senders = coordinator_reconstruct(store, ctx)
    record = {"session_id": ctx.session_id, "total": total, "senders": senders}
    with session(store, ctx, COORDINATOR) as records:
        records.artifacts.put(ctx.sum_key, record, "secure-sum", con=records.con)
        records.forget_older_sessions()
    return senders


def stored_sum(ctx: SumContext) -> tuple[np.ndarray, list[str]]:
    """The coordinator's decoded sum of this session and its senders (coordinator side only)."""
    stored = ArtifactStore(coordinator_store(ctx.workspace)).get(ctx.sum_key)
    if stored is None or stored["session_id"] != ctx.session_id:
        raise RoundStateError(f"coordinator: no sum of session {ctx.session_id}")
    return np.asarray(stored["total"], dtype=np.float64), list(stored["senders"])


# ---------------------------------------------------------------------------------------------
# Orchestration: one whole session over stored vectors (called from a flow)

Present = Callable[[str, list[str]], list[str]]
"""``(stage, parties) -> parties that take part``: lets tests silence parties at a stage."""


def _everyone(stage: str, parties: list[str]) -> list[str]:
    return parties


def each_party(
    step: Any, refs: dict[str, TableRef], parties: Sequence[str], *args: Any
) -> dict[str, Any]:
    """Run a party step for ``parties``; return the results of those that finished.

    A party whose step still fails after its retries with a transient error (I/O, a missing
    message) has dropped out: the coordinator's next step goes on without it. Refused input,
    protocol violations and budget refusals (``ValueError``, ``BudgetError``) fail the flow.
    """
    done: dict[str, Any] = {}
    for party in parties:
        state = step(refs[party], *args, return_state=True)
        if state.is_completed():
            done[party] = state.result()
            continue
        error = state.result(raise_on_failure=False)
        if not isinstance(error, Exception) or isinstance(error, ValueError | BudgetError):
            state.result()  # raises the failure
        get_run_logger().warning("%s dropped out at %s: %s", party, step.name, error)
    return done


def sum_stored_vectors(
    refs: dict[str, TableRef],
    ctx: SumContext,
    input_key: str,
    parties: Sequence[str] | None = None,
    present: Present = _everyone,
) -> list[str]:
    """One secure-sum session over the vectors stored under ``input_key`` in each party's store.

    The decoded sum ends in the coordinator's store (:func:`stored_sum`); returns the parties
    whose vectors it contains. Only the parties the coordinator answered go on to each next
    step, so the session completes while at least ``ctx.threshold`` remain.
    """
    live = present("advertise_keys", list(parties if parties is not None else refs))
    each_party(advertise_keys, refs, live, ctx)
    live = present("share_keys", publish_key_directory(ctx))
    each_party(share_keys, refs, live, ctx)
    live = present("mask_input", route_shares(ctx))
    each_party(mask_stored_input, refs, live, ctx, input_key)
    live = present("reveal_shares", collect_masked(ctx))
    each_party(reveal_shares, refs, live, ctx)
    return unmask_sum(ctx)
