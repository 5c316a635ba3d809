"""A hospital's steps of horizontal logistic regression: check its table, announce its columns,
join, then per round mask its update, answer the unmasking, and check and save the model.
More (why it checks each model): "across rounds" in docs/protocols/horizontal-lr.md."""

from __future__ import annotations

import functools
import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from prefect import task

from core import horizontal_lr as hlr
from core import secagg, test_switches
from core.dp.distributed import DistributedGaussian
from core.job_schema import HorizontalOptions
from core.model_format import ModelRecord
from core.secagg.errors import ProtocolViolationError
from federation.channel import PartyEndpoint
from storage import models
from storage.artifacts import Artifact, ArtifactStore
from storage.descriptor import TableRef
from storage.ledger import PrivacyLedger
from storage.party_store import PartyStore
from tasks import secure_rounds, secure_sum
from tasks import secure_rounds_party as rounds_party
from tasks.horizontal_lr import (
    MECHANISM,
    PROTOCOL,
    RoundCall,
    checkpoints,
    dp_clip,
    dp_noise,
    dp_release_key,
    dp_terms,
    model_key,
    model_record,
    model_weights,
    n_features,
    rounds_job,
    status,
    trained_columns,
    training,
)
from tasks.loading import fingerprint
from tasks.policy import PARTY_STEP, is_transient
from tasks.preprocessing import stored_fitted
from tasks.reporting import provenance
from tasks.secure_sum import COORDINATOR, RoundStateError, run_logger
from tasks.summaries import holdout_split

#: The stages of a round at which a hospital can drop (test switch ``PRIVREG_TEST_FAULTS``).
STAGES = ("mask_input", "reveal_shares")


@dataclass(frozen=True)
class Hospital:
    """One hospital's side of a job, built once by its flow when the columns are agreed (its
    options' hold-out is its own choice, never sent)."""

    ref: TableRef
    endpoint: PartyEndpoint = field(compare=False, repr=False)
    parties: tuple[str, ...]
    features: tuple[str, ...]
    width: int  # the model's columns (missing indicators too): :func:`model_width`
    options: HorizontalOptions
    dp_charge: str | None = None  # under DP: the ledger's key of the job's charge, once booked

    @property
    def party(self) -> str:
        return self.endpoint.party

    @property
    def job_id(self) -> str:
        return self.endpoint.channel.run

    @property
    def store(self) -> PartyStore:
        return PartyStore.of(self.ref)

    def agreed(self) -> secure_rounds.RoundsJob:
        """The job's terms from this hospital's own options: every call must state them."""
        threshold = self.options.threshold or secagg.default_threshold(len(self.parties))
        return rounds_job(
            self.job_id, self.parties, threshold, self.width, self.options.stage_timeout
        )

    @property
    def noise(self) -> DistributedGaussian | None:
        """The job's distributed-DP noise from this hospital's own options (None: no DP)."""
        return dp_noise(self.options, self.agreed())

    def called(self, call: RoundCall) -> secure_rounds.RoundsJob:
        """The job's terms as a (checked) call states them."""
        return rounds_job(self.job_id, call.parties, call.threshold, self.width, call.stage_timeout)

    @functools.cached_property
    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The training rows (scaled, hold-out removed), read once per side: reading them every
        round cost more than the round's work, and a run takes the table as fixed."""
        fitted = stored_fitted(self.ref.database, self.job_id)  # pooled statistics, if any
        frame = self.store.read_table(self.ref, allow_missing=fitted is not None)
        X, y = hlr.party_arrays(frame, list(self.features), self.ref.label_column or "")
        if fitted is not None:
            X = fitted.transform(X, f"party {self.party}, table {self.ref.table!r}")
        train = holdout_split(len(y), self.options.holdout_fraction, self.job_id)[0]
        return X[train], y[train]  # held-out rows never reach an update


# ---------------------------------------------------------------------------------------------
# Before any round: the hospital checks its own table and announces its columns


@task(name="hlr-check-table", task_run_name="{ref.party}: check {ref.table}", **PARTY_STEP)
def check_table(ref: TableRef) -> str:
    """Validate the party's own table; return a digest of it (for the job id), salted with the
    party's secret, so it only tells a later run "changed or not"."""
    store = PartyStore.of(ref)
    artifacts = ArtifactStore(store)
    with store.transaction() as con:
        found = con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [ref.table]
        ).fetchone()[0]
        if found and con.execute(f'SELECT count(*) FROM "{ref.table}"').fetchone()[0] == 0:
            raise hlr.EmptyPartyError(
                f"party {ref.party!r}: table {ref.table!r} has no rows", party=ref.party
            )
        salt = artifacts.get(f"{PROTOCOL}/fingerprint-salt", con=con)
        if salt is None:
            salt = secrets.token_bytes(32)
            artifacts.put(f"{PROTOCOL}/fingerprint-salt", salt, "secret", con=con)
    frame, _ = _own_table(ref, store)
    digest = hashlib.sha256(salt)
    digest.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    digest.update(",".join(map(str, frame.columns)).encode())
    return digest.hexdigest()


@task(name="hlr-join-job", task_run_name="{ref.party}: announce columns", **PARTY_STEP)
def join_job(ref: TableRef, endpoint: PartyEndpoint) -> dict[str, Any]:
    """Send the coordinator the label and feature column names (no rows, no row count); return
    the party's last finished round of this job, so a re-run can resume."""
    store = PartyStore.of(ref)
    features = _own_table(ref, store)[1]
    schema = {"label_column": ref.label_column, "feature_columns": features}
    endpoint.send(COORDINATOR, "schema", schema)
    return status(store, endpoint.channel.run)


def _own_table(ref: TableRef, store: PartyStore) -> tuple[pd.DataFrame, list[str]]:
    """The party's table, validated against its descriptor, and its feature columns; missing
    cells pass here (they are imputed or refused before training)."""
    frame = store.read_table(ref, allow_missing=True)
    label = ref.label_column or ""
    features = hlr.validate_party_tables(
        {ref.party: frame}, label, ref.id_column, allow_missing=True
    )
    return frame, features


def agreed_features(endpoint: PartyEndpoint) -> list[str]:
    """The feature order the coordinator agreed (after :func:`join_job`)."""
    return list(endpoint.receive(COORDINATOR, "schema_agreed")["feature_columns"])


@task(name="hlr-join-rounds", task_run_name="{side.party}: job keys", **PARTY_STEP)
def join_rounds(side: Hospital, round_: int) -> str | None:
    """Once per job: this party's key pair under its own terms, sent with ``round_``; under DP
    the job is charged first (:func:`charge_privacy`), and the charge's key returned."""
    charge = charge_privacy(side)
    rounds_party.party_join(side.store, side.agreed(), side.endpoint, round_, agreed=True)
    return charge


def charge_privacy(side: Hospital) -> str | None:
    """Under DP: book every round of the job on this hospital's table once, before its first
    noisy sum leaves (docs/protocols/horizontal-lr.md); returns the key (None without DP)."""
    noise, terms = side.noise, dp_terms(side.options)
    if noise is None or terms is None:
        return None
    ref, job = side.ref, side.agreed()
    key = dp_release_key(fingerprint.fn(ref), job, terms)
    booked = {"rounds": noise.rounds, "sigma": noise.sigma, "share_sigma": noise.share_sigma,
              "sensitivity": noise.sensitivity, "honest_shares": noise.honest}  # fmt: skip
    PrivacyLedger(side.store).charge_and_store(
        key, ref.table, terms["epsilon"], terms["delta"], MECHANISM, side.job_id, booked,
        event=noise.job_event(),
    )  # fmt: skip
    return key


# ---------------------------------------------------------------------------------------------
# One round (plain steps: the hospital's rounds task calls them)


def _weights_before(side: Hospital, job: secure_rounds.RoundsJob, round_: int) -> np.ndarray:
    """The model a round starts from: zeros, or this party's own checkpoint of the last round."""
    if round_ == 0:
        return hlr.init_model(n_features(job))
    try:
        saved = checkpoints(side.store, side.job_id).load(round_ - 1)
    except KeyError:
        raise RoundStateError(f"{side.party}: no checkpoint of round {round_ - 1}") from None
    return np.asarray(saved["weights"], dtype=np.float64)


def model_point(weights: np.ndarray) -> str:
    """Digest of a model, naming the point at which a party computed its update."""
    return hashlib.sha256(np.ascontiguousarray(weights, dtype="<f8").tobytes()).hexdigest()


def _checked_call(side: Hospital, round_: int) -> RoundCall:
    """The coordinator's call for ``round_``, if it names the parties and the training options
    this party agreed to (else refused, naming what differs)."""
    call = RoundCall.from_message(side.endpoint.receive(COORDINATOR, "round", round=round_))
    where = f"{side.party}: the coordinator's call for round {round_} of job {side.job_id}"
    if sorted(call.parties) != sorted(side.parties):
        raise ProtocolViolationError(
            f"{where} names parties {list(call.parties)}, not {list(side.parties)}"
        )
    own = training(side.options)
    if call.training[:3] != own:
        raise ProtocolViolationError(
            f"{where} asks for local_epochs, learning_rate, l2 = {call.training[:3]}, not the "
            f"agreed {own}"
        )
    if call.dp != (own_dp := dp_terms(side.options)):
        raise ProtocolViolationError(
            f"{where} states privacy terms {call.dp}, not the agreed {own_dp}"
        )
    return call


def _dp_input(side: Hospital, job: secure_rounds.RoundsJob, round_: int, weights: np.ndarray,
              noise: DistributedGaussian) -> np.ndarray:  # fmt: skip
    """Under DP: the clipped vector in the ring with this hospital's noise share, only for a
    round the job's charge covers (booked before any noisy sum leaves)."""
    where = f"party {side.party!r}: round {round_} of job {side.job_id}"
    charged = side.dp_charge and PrivacyLedger(side.store).stored_release(side.dp_charge)
    if not charged or round_ >= charged["rounds"]:
        raise ProtocolViolationError(f"{where} is not covered by a privacy charge; refused")
    X, y = side.rows
    vector = hlr.clipped_contribution(weights, X, y, side.options.dp_clip_norm)
    return hlr.noisy_ring_input(vector, noise, len(job.parties), job.scale_bits,
                                side.options.dp_clip_norm, f"party {side.party!r}")  # fmt: skip


def _mask(
    side: Hospital, job: secure_rounds.RoundsJob, round_: int, call: RoundCall
) -> tuple[np.ndarray, dict[str, Any]]:
    """Send the local update at the round's model masked, once a round and once a model (why:
    docs/protocols/horizontal-lr.md); returns that model and the stored record."""
    store, options = side.store, side.options
    with store.session():  # one opening of the database for the reads and the stored state
        weights = _weights_before(side, job, round_)
        X, y = side.rows
        noise = side.noise
        if noise is not None:
            vector = _dp_input(side, job, round_, weights, noise)
        elif options.local_epochs == 0:
            vector = hlr.local_gradient(weights, X, y, options.l2).packed()
        else:
            vector = hlr.local_epochs(
                weights, X, y, options.l2, options.learning_rate, options.local_epochs
            ).packed()
        point_key = f"{PROTOCOL}/{side.job_id}/point/{model_point(weights)}"

        def one_round_per_model(con: Any) -> list[Artifact]:
            seen = ArtifactStore(store).get(point_key, con=con)
            if seen is not None and seen != round_:
                raise ProtocolViolationError(
                    f"party {side.party!r}: the coordinator asks for round {round_} of job "
                    f"{side.job_id} at the same model as round {seen}; refusing to contribute "
                    "twice at one model (the difference of two such sums would reveal single "
                    "updates)"
                )
            return [Artifact(point_key, round_, "secagg-point")]  # stored with the mask

        start = rounds_party.round_start(job, round_, call.protocol, side.party)
        record = rounds_party.party_mask(
            store, job, side.endpoint, start, vector, one_round_per_model
        )
    return weights, record


def _await_request(endpoint: PartyEndpoint, job: secure_rounds.RoundsJob, round_: int) -> bool:
    """Wait for the round's unmask request; False once the round's model is out without it
    (dropped)."""
    return secure_sum.await_coordinator(
        endpoint,
        secure_rounds.REQUEST,
        round_,
        lambda: secure_sum.coordinator_sent(endpoint, "model", round_),
        job.stage_timeout,
    )


def _answer(
    side: Hospital, job: secure_rounds.RoundsJob, round_: int, record: dict[str, Any]
) -> dict[str, Any]:
    """Answer the round's unmask request (once); returns the new record, for the checkpoint."""
    request = side.endpoint.receive(COORDINATOR, secure_rounds.REQUEST, round=round_)
    return rounds_party.party_answer(side.store, job, side.endpoint, round_, request, record)


def verified_model(
    message: dict[str, Any],
    before: np.ndarray,
    options: HorizontalOptions,
    who: str,
    round_: int,
    own_sum: np.ndarray | None = None,
) -> np.ndarray:
    """The broadcast weights, if exactly ``before`` moved by the mean update, itself exactly that
    of ``own_sum`` (its own unmasking, if it helped; why: docs/protocols/horizontal-lr.md)."""
    where = f"{who}: coordinator's model of round {round_}"
    mean = np.asarray(message.get("mean_update", ()), dtype=np.float64)
    weights = np.asarray(message["weights"], dtype=np.float64)
    if mean.shape != before.shape or not np.all(np.isfinite(mean)):
        raise ProtocolViolationError(
            f"{where} carries no usable mean update (shape {mean.shape}, expected {before.shape})"
        )
    clip = dp_clip(options)
    own_mean = None if own_sum is None else hlr.round_mean(own_sum, before, options.l2, clip).mean
    if own_mean is not None and not np.array_equal(mean, own_mean):
        raise ProtocolViolationError(
            f"{where}: its mean update is not the one of the sum {who} unmasked from its peers' "
            "messages; refusing it (a made-up update could unmask one party across rounds)"
        )
    expected = hlr.next_model(before, mean, options.local_epochs, options.learning_rate)
    if weights.shape != expected.shape or not np.array_equal(weights, expected):
        raise ProtocolViolationError(
            f"{where} is not the update of round {round_ - 1}'s model by the mean it sent; "
            "refusing it (a coordinator choosing the model could unmask one party across rounds)"
        )
    return weights


def _finish(
    side: Hospital,
    job: secure_rounds.RoundsJob,
    round_: int,
    call: RoundCall,
    known: tuple[np.ndarray, dict[str, Any]] | None = None,
) -> None:
    """Receive the round's model, verify it and checkpoint the round. ``known``: the model
    before and this party's record, as its own earlier steps left them (else read)."""
    store, endpoint = side.store, side.endpoint
    # out at most two stage deadlines after the call (masked inputs, answers), then as usual
    wait = 2 * job.stage_timeout + endpoint.channel.timeout
    message = endpoint.receive(COORDINATOR, "model", round=round_, timeout=wait)
    if message["round"] != round_:
        raise RoundStateError(f"{side.party}: the model message of round {round_} is another's")
    if known is None:
        with store.session():
            before = _weights_before(side, job, round_)
            record = secure_rounds.load_record(store, job, side.party)
    else:
        before, record = known
    own_sum = rounds_party.party_sum(
        job, side.endpoint, record, call.protocol, round_, message.get("revealers"),
        job.stage_timeout,
    )  # fmt: skip
    weights = verified_model(message, before, side.options, side.party, round_, own_sum)
    cps = checkpoints(store, side.job_id)
    with store.transaction() as con:
        state = {"weights": weights, "change": message["change"]}
        if known is not None:  # the round's answer, stored with its checkpoint
            also = [cps.item(round_, state)]
            secure_rounds.save_record(store, job, side.party, record, con, also=also)
        else:
            cps.save(round_, state, con=con)


def _party_round(
    side: Hospital,
    round_: int,
    fault: test_switches.PartyFault | None = None,
    faults: secure_sum.Faults = secure_sum.NO_FAULTS,
) -> bool:
    """This hospital's whole round; False on the coordinator's stop. Left out by the call, it
    re-keys and asks to rejoin; a round it masked already (a restart) is re-sent from its
    records, and one whose model is out (it missed it) is only checked and saved."""
    call = _checked_call(side, round_)
    if call.stop:
        return False
    job, endpoint = side.called(call), side.endpoint
    model_out = secure_sum.coordinator_sent(endpoint, "model", round_)

    def faulted(stage: str) -> bool:  # tests only: :func:`tasks.secure_sum.stage_fault`
        return secure_sum.stage_fault(fault, faults, side.party, round_, stage, job.stage_timeout)

    if side.party in call.out:
        with side.store.session():
            rounds_party.party_rejoin(side.store, job, endpoint, round_)
    elif not model_out and not faulted("mask_input"):
        before, record = _mask(side, job, round_, call)
        relay = functools.partial(secure_sum.prefetch, endpoint, COORDINATOR)
        relay(secure_rounds.MASKED_RELAY, round_, job.stage_timeout)
        if _await_request(endpoint, job, round_):
            if not faulted("reveal_shares"):
                record = _answer(side, job, round_, record)  # stored with the checkpoint below
                relay(secure_rounds.RESPONSE_RELAY, round_, job.stage_timeout)
            _finish(side, job, round_, call, (before, record))
            return True
    _finish(side, job, round_, call)
    return True


# ---------------------------------------------------------------------------------------------
# The rounds as task runs, then the model


ROUND_GROUP_SECONDS = 5.0
"""A hospital's task run goes on to its next round until it has run this long (party mode)."""


@dataclass(frozen=True)
class RoundsRun:
    """What one task run of a hospital's rounds did: the round it stopped before, and why."""

    next_round: int
    stopped: bool


def _retried(task: Any, task_run: Any, state: Any) -> bool:
    """A hospital's rounds retry transient faults (:func:`tasks.policy.is_transient`), but not
    an injected crash (tests), which stands for this process's death."""
    try:
        state.result()
    except secure_sum.SimulatedCrashError:
        return False
    except Exception:
        pass
    return is_transient(task, task_run, state)


@task(
    name="hlr-party-rounds",
    task_run_name="rounds from {first}: {side.party}",
    **{**PARTY_STEP, "retry_condition_fn": _retried},
)
def party_rounds(
    side: Hospital,
    first: int,
    fault: test_switches.PartyFault | None = None,
    faults: secure_sum.Faults = secure_sum.NO_FAULTS,
    group_seconds: float = ROUND_GROUP_SECONDS,
) -> RoundsRun:
    """This hospital's rounds from ``first`` as one task run, until the stop or ``group_seconds``
    (why: docs/protocols/horizontal-lr.md); a retry goes on after the last saved round.
    ``fault``, ``faults``: tests only (:func:`tasks.secure_sum.stage_fault`)."""
    started = time.monotonic()
    first = max(first, checkpoints(side.store, side.job_id).last_round() + 1)
    round_ = first
    try:
        while True:
            if not _party_round(side, round_, fault, faults):
                return RoundsRun(round_, stopped=True)
            round_ += 1
            if time.monotonic() - started >= group_seconds:
                return RoundsRun(round_, stopped=False)
    finally:
        if round_ > first:
            run_logger().info(
                "%s: rounds %d-%d masked, answered, model checked and saved",
                side.party,
                first,
                round_ - 1,
            )


def forget_rounds(side: Hospital) -> None:
    """After the stop: shred this party's secure-aggregation secrets of the job."""
    secure_rounds.forget_job(side.store, side.agreed())


def _model_rows(
    ref: TableRef, store: PartyStore, job_id: str, holdout: float
) -> tuple[list[object], list[object]]:
    """The ids this party's copy of the model trained on and held out (the job's seeded
    split), saved with it so scoring's ``in_training`` column says which rows it saw."""
    ids = store.read_table(ref, allow_missing=True)[ref.id_column].to_numpy(dtype=object)
    train, held_out = holdout_split(len(ids), holdout, job_id)
    return ids[train].tolist(), ids[held_out].tolist()


@task(name="hlr-keep-model", task_run_name="{side.party}: keep the model", **PARTY_STEP)
def keep_model(side: Hospital) -> dict[str, Any]:
    """After the coordinator's stop: this party's own copy of the last verified model, with
    the ids it trained on and held out (its own hold-out fraction)."""
    ref, store, job_id = side.ref, side.store, side.job_id
    cps = checkpoints(store, job_id)
    last = cps.last_round()
    if last < 0:
        raise RoundStateError(f"{ref.party}: job {job_id} stopped before any round finished")
    saved = cps.load(last)
    fitted = stored_fitted(ref.database, job_id)
    features = trained_columns(fitted, list(side.features))
    model = model_record(
        job_id, features, saved["weights"], last + 1, fitted and fitted.to_dict(), provenance(ref)
    )
    rows = _model_rows(ref, store, job_id, side.options.holdout_fraction)
    models.ModelStore(store).save(model_key(job_id), ModelRecord.from_dict(model), *rows)
    cps.prune(keep_last=2)
    return {**model, "weights": model_weights(model).tolist()}
