"""Secure summation of one vector per party (:mod:`core.secagg`), one task per party step,
and the waits every coordinator-led protocol shares (:func:`collect`, :func:`survivors`,
:func:`announced`, :func:`await_coordinator`). Training rounds use :mod:`tasks.secure_rounds`.

More (the stages, dropouts, why each step stores before it sends): docs/secure-aggregation.md."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from prefect import Task, get_run_logger, task
from prefect.exceptions import MissingContextError

from core import secagg, test_switches
from federation.channel import ChannelError, MessageConflictError, PartyEndpoint
from federation.party_config import active_config
from federation.status import PeerFailedError
from federation.watchers import in_context
from federation.workspace import channel_for, workspace_root
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import BudgetError
from storage.party_store import PartyStore
from storage.secrets import JobSecrets, SecretGoneError
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
    stage_timeout: float = 60.0  # seconds a stage waits for the parties' answers

    def endpoint(self, party: str) -> PartyEndpoint:
        return channel_for(self.job_id, self.workspace).endpoint(party)

    def config(self) -> secagg.SessionConfig:
        return secagg.new_session(
            self.session_id, list(self.parties), self.threshold, self.dimension, self.scale_bits
        )

    def kind(self, name: str) -> str:
        """``name`` as a message kind of this session (why: docs/secure-aggregation.md)."""
        return f"{name}.{hashlib.sha256(self.session_id.encode()).hexdigest()[:12]}"

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


def coordinator_store(root: str | None = None) -> PartyStore:
    """The coordinator's own store, in the folder of the party this code runs as; ``root`` only
    where no party is active (a helper that reads a run's results)."""
    config = active_config()
    folder = workspace_root(root) if config is None else config.root
    return PartyStore(folder / "parties" / f"{COORDINATOR}.duckdb")


class SessionRecords:
    """A holder's secagg records of the current session, in one transaction; :meth:`once`
    stores a step's sealed state with its message before it is sent (a retry re-sends it)."""

    def __init__(self, store: PartyStore, con: Any, ctx: SumContext, who: str) -> None:
        self.artifacts, self.con, self.ctx, self.who = ArtifactStore(store), con, ctx, who
        self.secrets = JobSecrets.of(store, ctx.prefix.rstrip("/"))

    def _label(self, step: str) -> str:
        return f"{self.ctx.prefix}{step}/{self.ctx.session_id}"

    def _record(self, step: str) -> dict[str, Any] | None:
        """This session's record of ``step`` (its state unsealed), or None: none stored, another
        session's, or sealed under a key already shredded (an interrupted clean-up)."""
        record = self.artifacts.get(self.ctx.prefix + step, con=self.con)
        if not record or record["session_id"] != self.ctx.session_id:
            return None
        try:
            return {**record, "state": self.secrets.open(record["state"], self._label(step))}
        except SecretGoneError:
            return None

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
            sealed = self.secrets.seal(state, self._label(step))
            record = {"session_id": self.ctx.session_id, "state": sealed, "outbox": outbox}
            self.artifacts.put(self.ctx.prefix + step, record, "secagg-state", con=self.con)
        return record["outbox"]

    def forget_older_sessions(self) -> None:
        """Drop the records of an aborted attempt (or of this one, once done) and their key."""
        self.artifacts.delete_prefix(self.ctx.prefix, con=self.con)
        self.secrets.destroy()


@contextmanager
def session(store: PartyStore, ctx: SumContext, who: str) -> Iterator[SessionRecords]:
    with store.transaction() as con:
        yield SessionRecords(store, con, ctx, who)


def gather(
    endpoint: PartyEndpoint, ctx: SumContext, kind: str, parties: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """This session's ``kind`` messages from ``parties`` (default all) that arrive within
    ``ctx.stage_timeout``, by sender (another attempt's count as none)."""
    parties = ctx.parties if parties is None else parties
    deadline = time.monotonic() + ctx.stage_timeout
    found = collect(endpoint, ctx.kind(kind), parties, ctx.round, deadline)
    return {
        party: found[party]
        for party in parties
        if isinstance(found.get(party), dict) and found[party].get("session_id") == ctx.session_id
    }


#: Seconds between the log lines of a wait that name who is still missing.
REPORT_EVERY = 5.0
#: Pause before asking again a peer whose endpoint refused at once (unreachable): only then
#: does a wait sleep on its own; otherwise it waits inside the channel's receive.
_UNREACHABLE_PAUSE = 0.05


def collect(
    endpoint: PartyEndpoint,
    kind: str,
    parties: Sequence[str],
    round_: int,
    deadline: float,
    report_every: float | None = REPORT_EVERY,
) -> dict[str, Any]:
    """The ``kind`` messages from ``parties`` that arrive before ``deadline``, by sender, waited
    for all at once; every ``report_every`` seconds it logs who is still missing, since when."""
    found: dict[str, Any] = {}
    started, started_at = time.monotonic(), time.strftime("%H:%M:%S")
    report_at = started + report_every if report_every else math.inf
    while missing := [p for p in parties if p not in found]:
        wait_for = max(0.0, min(deadline, report_at) - time.monotonic())
        if wait_for > 0 and len(missing) > 1:  # wait for all at once, each in its receive
            waits = [
                receivers().submit(in_context(_receive), endpoint, party, kind, round_, wait_for)
                for party in missing
            ]
            arrived = [w.result() for w in waits]
        else:
            arrived = [_receive(endpoint, party, kind, round_, wait_for) for party in missing]
        for party, arrived_message in zip(missing, arrived, strict=True):
            if arrived_message is not _NOTHING:
                found[party] = arrived_message
        now = time.monotonic()
        if now >= deadline:
            break
        still = [p for p in parties if p not in found]
        if now >= report_at and report_every and still:
            run_logger().info(
                "%s: still waiting for %s of round %d from %s, since %s (%.0f s); "
                "%.0f s left before they count as missing",
                endpoint.party,
                kind.split(".")[0],
                round_,
                ", ".join(still),
                started_at,
                now - started,
                deadline - now,
            )
            report_at = now + report_every
    return found


_NOTHING = object()
_RECEIVERS: list[ThreadPoolExecutor] = []
_RECEIVERS_LOCK = threading.Lock()


def receivers() -> ThreadPoolExecutor:
    """The threads that wait for messages side by side (started once: a start costs ms)."""
    with _RECEIVERS_LOCK:
        if not _RECEIVERS:
            _RECEIVERS.append(ThreadPoolExecutor(max_workers=64, thread_name_prefix="receive"))
        return _RECEIVERS[0]


def prefetch(
    endpoint: PartyEndpoint, sender: str, kind: str, round_: int = 0, timeout: float | None = None
) -> None:
    """Fetch ``sender``'s ``kind`` message of ``round_`` in the background (up to ``timeout``,
    default the channel's) for a later receive to read locally; no-op on a shared folder, and a
    fetch pending when the side ends ends with it."""
    if sender != endpoint.party and endpoint.channel.transport.party is not None:
        wait = endpoint.channel.timeout if timeout is None else timeout
        receivers().submit(in_context(_fetch_quietly), endpoint, sender, kind, round_, wait)


def _fetch_quietly(
    endpoint: PartyEndpoint, sender: str, kind: str, round_: int, timeout: float
) -> None:
    with contextlib.suppress(Exception):  # the protocol's own wait for it reports any failure
        endpoint.receive(sender, kind, round=round_, timeout=timeout)


def _receive(endpoint: PartyEndpoint, party: str, kind: str, round_: int, wait: float) -> Any:
    """One receive with the channel's own wait; ``_NOTHING`` if nothing came in time."""
    asked = time.monotonic()
    try:
        return endpoint.receive(party, kind, round=round_, timeout=wait)
    except (MessageConflictError, PeerFailedError):  # a peer's failure ends the wait at once
        raise
    except ChannelError:
        if wait > 0 and time.monotonic() - asked < wait / 2:  # refused at once, not a timeout
            time.sleep(min(_UNREACHABLE_PAUSE, wait))
        return _NOTHING


def run_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The run's logger inside a flow or task run, else this module's (a plain call)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


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
    ctx.endpoint(party).send(COORDINATOR, ctx.kind("secagg_keys"), message, round=ctx.round)


def party_share(store: PartyStore, ctx: SumContext, party: str) -> None:
    """Step 1: Shamir shares of the mask key and self-mask seed, encrypted per peer."""
    endpoint = ctx.endpoint(party)
    directory = endpoint.receive(COORDINATOR, ctx.kind("secagg_directory"), round=ctx.round)
    with session(store, ctx, party) as records:
        message = records.once(
            "share", lambda: secagg.share_keys(records.state("advertise"), directory)
        )
    endpoint.send(COORDINATOR, ctx.kind("secagg_shares"), message, round=ctx.round)


def party_mask(store: PartyStore, ctx: SumContext, party: str, vector: np.ndarray) -> None:
    """Step 2: send ``vector`` masked (a retry re-sends the stored masked message)."""
    endpoint = ctx.endpoint(party)
    delivery = endpoint.receive(COORDINATOR, ctx.kind("secagg_shares"), round=ctx.round)
    with session(store, ctx, party) as records:
        message = records.once(
            "mask", lambda: secagg.mask_input(records.state("share"), delivery, vector)
        )
    endpoint.send(COORDINATOR, ctx.kind("secagg_masked"), message, round=ctx.round)


def party_reveal(store: PartyStore, ctx: SumContext, party: str) -> None:
    """Step 3: shares that unmask the senders' sum (only that), for one set of senders a (job,
    round) (why: docs/secure-aggregation.md)."""
    endpoint = ctx.endpoint(party)
    request = endpoint.receive(COORDINATOR, ctx.kind("secagg_unmask_request"), round=ctx.round)
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
    endpoint.send(COORDINATOR, ctx.kind("secagg_unmask_response"), response, round=ctx.round)


def forget_session(store: PartyStore, ctx: SumContext, who: str) -> None:
    """Drop this session's secrets once the sum is out (the revealed-senders record stays)."""
    with session(store, ctx, who) as records:
        records.forget_older_sessions()


# ---------------------------------------------------------------------------------------------
# Coordinator steps: it relays, tracks who dropped, and unmasks only the sum


def coordinator_directory(
    store: PartyStore, ctx: SumContext, answered: Sequence[str] | None = None
) -> list[str]:
    """Step 0: the directory of public keys, to every advertiser; returns the advertisers."""
    endpoint = ctx.endpoint(COORDINATOR)
    advertisements = list(gather(endpoint, ctx, "secagg_keys", answered).values())
    with session(store, ctx, COORDINATOR) as records:

        def directory() -> tuple[Any, Any]:
            records.forget_older_sessions()
            return secagg.collect_key_advertisements(
                secagg.start_coordinator(ctx.config()), advertisements
            )

        message = records.once("directory", directory)
    for party in message["public_keys"]:
        endpoint.send(party, ctx.kind("secagg_directory"), message, round=ctx.round)
    return list(message["public_keys"])


def coordinator_route(
    store: PartyStore, ctx: SumContext, answered: Sequence[str] | None = None
) -> list[str]:
    """Step 1: forward the encrypted shares it cannot open; returns the share senders."""
    endpoint = ctx.endpoint(COORDINATOR)
    messages = list(gather(endpoint, ctx, "secagg_shares", answered).values())
    with session(store, ctx, COORDINATOR) as records:
        deliveries = records.once(
            "route", lambda: secagg.route_encrypted_shares(records.state("directory"), messages)
        )
    for party, delivery in deliveries.items():
        endpoint.send(party, ctx.kind("secagg_shares"), delivery, round=ctx.round)
    return list(deliveries)


def coordinator_collect(
    store: PartyStore, ctx: SumContext, answered: Sequence[str] | None = None
) -> list[str]:
    """Step 2: add the masked inputs; ask the senders to help unmask the sum."""
    endpoint = ctx.endpoint(COORDINATOR)
    messages = list(gather(endpoint, ctx, "secagg_masked", answered).values())
    with session(store, ctx, COORDINATOR) as records:
        request = records.once(
            "collect", lambda: secagg.collect_masked_inputs(records.state("route"), messages)
        )
    for party in request["input_senders"]:
        endpoint.send(party, ctx.kind("secagg_unmask_request"), request, round=ctx.round)
    return list(request["input_senders"])


def coordinator_reconstruct(
    store: PartyStore, ctx: SumContext, answered: Sequence[str] | None = None
) -> tuple[np.ndarray, list[str]]:
    """Step 3: the decoded sum of the input senders, and who they are (deterministic)."""
    with session(store, ctx, COORDINATOR) as records:
        state = records.state("collect")
    endpoint = ctx.endpoint(COORDINATOR)
    responses = list(gather(endpoint, ctx, "secagg_unmask_response", answered).values())
    _, aggregate = secagg.reconstruct_sum(state, responses)
    total = secagg.decode(aggregate["ring_sum"], state["config"]["scale_bits"])
    return total, list(aggregate["input_senders"])


# ---------------------------------------------------------------------------------------------
# Tasks: a vector that each party stored in its own store, summed at the coordinator


def _party_task(
    name: str, step: Callable[[PartyStore, SumContext, str], None]
) -> Task[[TableRef, SumContext], None]:
    """Task ``secagg-<name>``: ``step`` on the store of the party ``ref`` names."""

    def run(ref: TableRef, ctx: SumContext) -> None:
        step(PartyStore.of(ref), ctx, ref.party)

    run.__qualname__ = name.replace("-", "_")  # the task's key: each step's runs are its own
    what = f"round {{ctx.round}}: {{ref.party}} {name.replace('-', ' ')}"
    return task(name=f"secagg-{name}", task_run_name=what, **PARTY_STEP)(run)


def _coordinator_task(
    name: str, what: str, step: Callable[[PartyStore, SumContext, Any], list[str]]
) -> Task[[SumContext, list[str] | None], list[str]]:
    """Task ``secagg-<name>``: ``step`` on the coordinator's store, for those that answered."""

    def run(ctx: SumContext, answered: list[str] | None = None) -> list[str]:
        return step(coordinator_store(ctx.workspace), ctx, answered)

    run.__qualname__ = name.replace("-", "_")
    run_name = f"round {{ctx.round}}: coordinator {what}"
    return task(name=f"secagg-{name}", task_run_name=run_name, **PARTY_STEP)(run)


advertise_keys = _party_task("advertise-keys", party_advertise)
share_keys = _party_task("share-keys", party_share)
reveal_shares = _party_task("reveal-shares", party_reveal)
publish_key_directory = _coordinator_task("key-directory", "publish keys", coordinator_directory)
route_shares = _coordinator_task("route-shares", "route shares", coordinator_route)
collect_masked = _coordinator_task("collect-masked", "add masked", coordinator_collect)


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
    name="secagg-unmask-sum",
    task_run_name="round {ctx.round}: coordinator unmask sum",
    **PARTY_STEP,
)
def unmask_sum(ctx: SumContext, answered: list[str] | None = None) -> list[str]:
    """Store the decoded sum under ``ctx.sum_key`` (the coordinator's store, dropping the
    session's secrets in the same transaction); return its senders, on a retry the stored ones."""
    store = coordinator_store(ctx.workspace)
    stored = session_sum(store, ctx)
    if stored is not None:
        return list(stored["senders"])
    total, senders = coordinator_reconstruct(store, ctx, answered)
    record = {"session_id": ctx.session_id, "total": total, "senders": senders}
    with session(store, ctx, COORDINATOR) as records:
        records.artifacts.put(ctx.sum_key, record, "secure-sum", con=records.con)
        records.forget_older_sessions()
    return senders


def session_sum(store: PartyStore, ctx: SumContext) -> dict[str, Any] | None:
    """The coordinator's stored sum record of ``ctx.sum_key``, if this session's (else None)."""
    stored = ArtifactStore(store).get(ctx.sum_key)
    return stored if stored is not None and stored["session_id"] == ctx.session_id else None


def stored_sum(ctx: SumContext) -> tuple[np.ndarray, list[str]]:
    """The coordinator's decoded sum of this session and its senders (coordinator side only)."""
    stored = session_sum(coordinator_store(ctx.workspace), ctx)
    if stored is None:
        raise RoundStateError(f"coordinator: no sum of session {ctx.session_id}")
    return np.asarray(stored["total"], dtype=np.float64), list(stored["senders"])


# ---------------------------------------------------------------------------------------------
# Orchestration: the one driver of a session's stages (called from flows)

#: What a party may answer with instead of a result: a refusal stops the run, anything else
#: (an exception, a hang, a killed process) only drops the party from the session.
REFUSALS: tuple[type[Exception], ...] = (secagg.ProtocolViolationError, BudgetError)


class SimulatedCrashError(RuntimeError):
    """Raised by the fault injector (tests only): stands in for a crash or a killed process."""


@dataclass(frozen=True)
class Faults:
    """Test-only fault injection from the job's test switches (empty in production):
    ``PRIVREG_TEST_FAULTS`` and ``PRIVREG_TEST_CRASH_AFTER``, docs/operator.md#test-switches."""

    parties: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    crash_after: str | None = None

    @classmethod
    def of_job(
        cls, job_id: str, names: Sequence[str], stages: Sequence[str] = secagg.DROPOUT_STAGES
    ) -> Faults:
        """``job_id``'s faults, checked against the protocol's ``stages`` (default: the
        single-session ones) and the job's parties (an unknown one is refused)."""
        stages = tuple(stages)
        parties = test_switches.step_faults(job_id)
        for key, faults in parties.items():
            round_, _, stage = key.partition(":")
            if not (round_ == "*" or round_.isdigit()) or stage not in stages:
                raise test_switches.TestSwitchError(
                    f"{test_switches.FAULTS_VARIABLE}: key {key!r} of job {job_id} must be "
                    f"'<round or *>:<stage>' with a stage in {stages}"
                )
            if unknown := sorted(set(faults) - set(names)):
                raise test_switches.TestSwitchError(
                    f"{test_switches.FAULTS_VARIABLE}[{job_id!r}][{key!r}]: unknown parties "
                    f"{unknown} (the job's: {list(names)})"
                )
        crash_after = test_switches.crash_after(job_id)
        if crash_after is not None and crash_after.partition(":")[2] not in (*stages, "commit"):
            raise test_switches.TestSwitchError(
                f"{test_switches.CRASH_VARIABLE}: the point of {crash_after!r} must be one of "
                f"{(*stages, 'commit')}"
            )
        return cls({k: dict(v) for k, v in parties.items()}, crash_after)

    def at(self, round_: int, stage: str) -> dict[str, str]:
        return {**self.parties.get(f"*:{stage}", {}), **self.parties.get(f"{round_}:{stage}", {})}

    def crash_point(self, round_: int, point: str) -> None:
        if self.crash_after == f"{round_}:{point}":
            raise SimulatedCrashError(f"injected crash after {point!r} in round {round_}")


NO_FAULTS = Faults()


@task(
    name="secagg-injected-fault",
    task_run_name="round {round_}: {party} {stage} (injected {kind}, test only)",
    cache_policy=PARTY_STEP["cache_policy"],
)
def injected_fault(party: str, stage: str, round_: int, kind: str, hang_seconds: float) -> None:
    """Stand-in for a party's step that fails (``raise``) or never answers (``hang``)."""
    if kind == "hang":
        time.sleep(hang_seconds)
        return
    raise SimulatedCrashError(f"{party}: injected failure at {stage} in round {round_}")


class Terms(Protocol):
    """What a quorum is counted against (:class:`SumContext`, a rounds job)."""

    job_id: str
    parties: tuple[str, ...]
    threshold: int


def survivors(
    terms: Terms,
    round_: int,
    stage: str,
    live: Sequence[str],
    found: Mapping[str, Any],
    timeout: float,
    gone: dict[str, str],
) -> list[str]:
    """Those of ``live`` whose message of ``stage`` is in ``found``; the others dropped (logged,
    added to ``gone`` with why). Fewer than the threshold abort, naming each missing party."""
    late = f"no answer within {timeout:g} s"
    for party in live:
        if party not in found:
            gone[party] = late
            run_logger().warning(
                "round %d of job %s: %s dropped out at %s (%s)",
                round_, terms.job_id, party, stage, late,
            )  # fmt: skip
    answered = [p for p in live if p in found]
    if len(answered) < terms.threshold:
        missing = "; ".join(f"{p} ({gone[p]})" for p in terms.parties if p in gone)
        raise secagg.InsufficientSurvivorsError(
            f"round {round_} of job {terms.job_id}, stage {stage}: only {len(answered)} of "
            f"{len(terms.parties)} parties answered ({answered}), fewer than the threshold "
            f"{terms.threshold}; missing: {missing}. The round is aborted: nothing was "
            "unmasked or committed"
        )
    return answered


def announced(endpoint: PartyEndpoint, kind: str, terms: Terms, timeout: float) -> dict[str, Any]:
    """The parties' ``kind`` messages of a job's start that arrive within ``timeout``, in the
    job's order; those missing are left out (logged), and fewer than the threshold fail."""
    found = collect(endpoint, kind, terms.parties, 0, time.monotonic() + timeout)
    missing = [p for p in terms.parties if p not in found]
    if len(found) < terms.threshold:
        raise secagg.InsufficientSurvivorsError(
            f"job {terms.job_id}: only {sorted(found)} announced their columns within "
            f"{timeout:g} s, fewer than the threshold {terms.threshold}; missing: {missing}"
        )
    if missing:
        run_logger().warning("job %s: %s did not announce columns", terms.job_id, missing)
    return {p: found[p] for p in terms.parties if p in found}


#: A session's stages: the party step, the message it sends the coordinator, and the
#: coordinator's answer to those that arrived (None: the last stage, answered by unmasking).
SESSION_STAGES: tuple[tuple[str, str, Any], ...] = (
    ("advertise_keys", "secagg_keys", publish_key_directory),
    ("share_keys", "secagg_shares", route_shares),
    ("mask_input", "secagg_masked", collect_masked),
    ("reveal_shares", "secagg_unmask_response", None),
)


def drive_session(ctx: SumContext) -> list[str]:
    """The one driver of a session's stages, at the coordinator (:func:`survivors` at each);
    returns those whose unmask shares arrived, for the caller to reconstruct from."""
    endpoint = ctx.endpoint(COORDINATOR)
    live = list(ctx.parties)
    gone: dict[str, str] = {}  # who dropped, and why (:func:`survivors`)
    for stage, kind, coordinator_step in SESSION_STAGES:
        found = gather(endpoint, ctx, kind, live)
        answered = survivors(ctx, ctx.round, stage, live, found, ctx.stage_timeout, gone)
        if coordinator_step is None:
            return answered
        live = coordinator_step(ctx, answered)  # those the coordinator heard (and answered)
    raise AssertionError("unreachable")


def stage_fault(
    fault: test_switches.PartyFault | None,
    faults: Faults,
    party: str,
    round_: int,
    stage: str,
    timeout: float,
) -> bool:
    """Test-only, just before a party's step of ``stage`` in ``round_``: ``fault`` kills or
    fails its side; True when ``faults`` replace the step by one that fails or hangs past
    ``timeout`` (docs/operator.md#test-switches)."""
    if fault is not None and (fault.round, fault.stage) == (round_, stage):
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise SimulatedCrashError(f"injected failure before {stage} in round {round_}")
    kind = faults.at(round_, stage).get(party)
    if kind is None:
        return False
    injected_fault(party, stage, round_, kind, timeout + 1.0, return_state=True)
    return True


def contribute(
    ref: TableRef,
    ctx: SumContext,
    mask_input: Callable[[], Any],
    ended: Callable[[], bool],
    fault: test_switches.PartyFault | None = None,
    faults: Faults = NO_FAULTS,
) -> None:
    """Party mode: this party's four steps (``mask_input`` the protocol's), each once the
    coordinator's message is there; stops when ``ended()`` says the session ended without it,
    or after a test fault (:func:`stage_fault`)."""
    endpoint = ctx.endpoint(ref.party)
    party_steps = (  # the stage, the coordinator's message it waits for, the party's step
        ("advertise_keys", None, lambda: advertise_keys(ref, ctx)),
        ("share_keys", "secagg_directory", lambda: share_keys(ref, ctx)),
        ("mask_input", "secagg_shares", mask_input),
        ("reveal_shares", "secagg_unmask_request", lambda: reveal_shares(ref, ctx)),
    )
    for stage, awaited, step in party_steps:
        if awaited is not None and not await_coordinator(
            endpoint, ctx.kind(awaited), ctx.round, ended, ctx.stage_timeout
        ):
            return
        if stage_fault(fault, faults, ref.party, ctx.round, stage, ctx.stage_timeout):
            return
        step()


def await_coordinator(
    endpoint: PartyEndpoint,
    kind: str,
    round_: int,
    ended: Callable[[], bool],
    stage_timeout: float = 0.0,
) -> bool:
    """Party mode: True once the coordinator's ``kind`` message of ``round_`` is there, False
    once ``ended()`` (asked each second) says the round is over without it; waits
    ``stage_timeout``, then the receive timeout (why: docs/secure-aggregation.md)."""
    deadline = time.monotonic() + stage_timeout + endpoint.channel.timeout
    while True:
        slice_end = min(deadline, time.monotonic() + _ENDED_CHECK)
        if collect(endpoint, kind, [COORDINATOR], round_, slice_end, None):
            return True
        if ended():
            return False
        if time.monotonic() >= deadline:
            endpoint.receive(COORDINATOR, kind, round=round_, timeout=0)


def coordinator_sent(endpoint: PartyEndpoint, kind: str, round_: int = 0) -> bool:
    """Party mode: whether the coordinator's ``kind`` message of ``round_`` is there already
    (no wait), e.g. the model, which tells a party the coordinator went on without it."""
    return bool(collect(endpoint, kind, [COORDINATOR], round_, 0, None))


#: How often a waiting party asks whether its session ended without it (seconds).
_ENDED_CHECK = 1.0
