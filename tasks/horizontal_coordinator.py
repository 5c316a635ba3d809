"""The coordinator's steps of horizontal logistic regression: compare the columns, admit the
keys, then per round (one task run) call, add the masked updates, unmask, commit and send the
model. It sees only the row-weighted mean update, the mean loss and the row count."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prefect import task

from core import horizontal_lr as hlr
from core.job_schema import HorizontalOptions
from federation.channel import PartyEndpoint
from storage.artifacts import ArtifactStore
from storage.party_store import PartyStore
from tasks import secure_rounds, secure_sum
from tasks import secure_rounds_coordinator as rounds_coordinator
from tasks.horizontal_lr import (
    PROTOCOL,
    RoundCall,
    checkpoints,
    dp_clip,
    dp_noise,
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
from tasks.policy import PARTY_STEP
from tasks.preprocessing import stored_fitted
from tasks.secure_sum import COORDINATOR, RoundStateError, run_logger
from tasks.summaries import current_attempt


@dataclass(frozen=True)
class Coordinator:
    """The coordinator's side of a job, built once by its flow (``width``: the model's, once the
    columns and statistics are agreed)."""

    endpoint: PartyEndpoint = field(compare=False, repr=False)
    store: PartyStore = field(compare=False, repr=False)
    parties: tuple[str, ...]
    threshold: int
    options: HorizontalOptions
    width: int = 0

    @property
    def job_id(self) -> str:
        return self.endpoint.channel.run

    @property
    def job(self) -> secure_rounds.RoundsJob:
        """The job's secure-aggregation terms, as every call states them."""
        return rounds_job(
            self.job_id, self.parties, self.threshold, self.width, self.options.stage_timeout
        )


def _schema_key(job_id: str) -> str:
    return f"{PROTOCOL}/{job_id}/schema"


@task(name="hlr-open-job", task_run_name="coordinator: compare columns", **PARTY_STEP)
def open_job(side: Coordinator) -> dict[str, Any]:
    """Refuse parties whose columns differ, send everyone the agreed order; returns the agreed
    features, who announced in time, and the coordinator's last finished round."""
    job_id = side.job_id
    schemas = secure_sum.announced(side.endpoint, "schema", side, side.options.join_timeout)
    announced = list(schemas)
    first, expected = announced[0], schemas[announced[0]]
    for party in announced[1:]:
        schema = schemas[party]
        if schema["label_column"] != expected["label_column"]:
            raise hlr.SchemaMismatchError(
                f"party {party!r}: label column {schema['label_column']!r} differs from party "
                f"{first!r}'s {expected['label_column']!r}",
                party=party,
                column=schema["label_column"],
            )
        missing = [c for c in expected["feature_columns"] if c not in schema["feature_columns"]]
        extra = [c for c in schema["feature_columns"] if c not in expected["feature_columns"]]
        if missing or extra:
            raise hlr.SchemaMismatchError(
                f"party {party!r}: feature columns differ from party {first!r}'s: "
                f"missing {missing}, extra {extra}",
                party=party,
                column=(missing + extra)[0],
            )
    ArtifactStore(side.store).put(_schema_key(job_id), expected, "schema")
    for party in side.parties:
        side.endpoint.send(party, "schema_agreed", expected)
    features = list(expected["feature_columns"])
    return {"features": features, "announced": announced, **status(side.store, job_id)}


@task(name="hlr-admit-keys", task_run_name="coordinator: job keys", **PARTY_STEP)
def admit_keys(side: Coordinator, round_: int, parties: list[str]) -> list[str]:
    """Once per job: the public keys of the parties it has none of, sent with ``round_``, until
    one deadline; returns the parties in the session."""
    store, job, timeout = side.store, side.job, side.options.stage_timeout
    with store.session():
        state = rounds_coordinator.coordinator_admit(store, job, {})
    wanted = [p for p in parties if p not in state.keys]
    if wanted:
        deadline = time.monotonic() + timeout
        found = secure_sum.collect(side.endpoint, secure_rounds.JOB_KEYS, wanted, round_, deadline)
        if missing := [p for p in wanted if p not in found]:
            run_logger().warning(
                "job %s: %s sent no keys within %g s; left out until they ask to rejoin",
                job.job_id,
                missing,
                timeout,
            )
        with store.session():
            state = rounds_coordinator.coordinator_admit(store, job, found)
    return list(state.active)


def refuse_if_stopped(side: Coordinator, round_: int) -> None:
    """A job whose hospitals were told to stop before ``round_`` cannot be called again: the
    stop is that round's call, sent once and never changed, so a hospital would stop again."""
    call = side.endpoint.sent(side.parties[0], "round", round_)
    if call is not None and call["stop"]:
        raise ValueError(
            f"job {side.job_id} ended after {round_} rounds (its hospitals were told to stop); "
            "to train longer, start a new job (another job id or seed)"
        )


# ---------------------------------------------------------------------------------------------
# One round: call, masked inputs, unmasking, model


def _call_round(side: Coordinator, round_: int, stop: bool = False) -> RoundCall:
    """Send every party the round's call (or the stop), a sent one as it was; first admit the
    left-out parties that asked to rejoin with new keys on the previous call."""
    store, endpoint, job = side.store, side.endpoint, side.job
    parties = list(side.parties)
    already = endpoint.sent(parties[0], "round", round=round_)
    if already is None:
        state = rounds_coordinator.coordinator_view(store, job)
        out = [p for p in parties if p not in state.active]
        if out and round_ > 0:
            back = secure_sum.collect(endpoint, secure_rounds.REJOIN, out, round_ - 1, 0, None)
            if back:
                run_logger().info(
                    "job %s: %s asked to rejoin with new keys; called again from round %d",
                    side.job_id,
                    sorted(back),
                    round_,
                )
                with store.session():
                    state = rounds_coordinator.coordinator_admit(store, job, back)
        out = [p for p in parties if p not in state.active]
        call = RoundCall(
            stop,
            tuple(parties),
            side.threshold,
            side.options.stage_timeout,
            (*training(side.options), side.options.tol),
            tuple(out),
            rounds_coordinator.call_keys(state),
            dp_terms(side.options),
        )
        already = call.to_message()
    endpoint.send_many(parties, "round", already, round=round_)
    return RoundCall.from_message(already)


@task(
    name="hlr-coordinator-round",
    task_run_name="round {round_}: coordinator",
    cache_policy=PARTY_STEP["cache_policy"],
)
def coordinator_round(
    side: Coordinator, round_: int, faults: secure_sum.Faults = secure_sum.NO_FAULTS
) -> dict[str, Any]:
    """The coordinator's whole round as one task run; returns the round's history entry, who was
    left out and who answered. ``faults``: tests only (a crash after a stage or the commit)."""
    started = time.time()
    call = _call_round(side, round_)
    active = list(call.protocol["active"]) if call.protocol else []
    gone = {p: "left out until it asks to rejoin with new keys" for p in call.out}
    senders = _await_stage(side, round_, "mask_input", secure_rounds.MASKED, active, gone)
    faults.crash_point(round_, "mask_input")
    senders = _collect(side, round_, senders)
    responders = _await_stage(side, round_, "reveal_shares", secure_rounds.RESPONSE, senders, gone)
    faults.crash_point(round_, "reveal_shares")
    entry = _commit_round(side, round_, started, responders, faults)
    return {"entry": entry, "left_out": list(call.out), "responders": responders}


def _await_stage(
    side: Coordinator, round_: int, stage: str, kind: str, live: list[str], gone: dict[str, str]
) -> list[str]:
    """Those of ``live`` whose ``kind`` message arrived by the stage's deadline
    (:func:`tasks.secure_sum.survivors`)."""
    timeout = side.options.stage_timeout
    found = secure_sum.collect(side.endpoint, kind, live, round_, time.monotonic() + timeout)
    return secure_sum.survivors(side, round_, stage, live, found, timeout, gone)


def _collect(side: Coordinator, round_: int, answered: list[str]) -> list[str]:
    inputs = secure_sum.collect(side.endpoint, secure_rounds.MASKED, answered, round_, 0)
    with side.store.session():
        senders, _ = rounds_coordinator.coordinator_collect(
            side.store, side.job, side.endpoint, round_, inputs
        )
    return senders


def _commit_round(
    side: Coordinator,
    round_: int,
    started: float,
    responders: list[str] | None,
    faults: secure_sum.Faults = secure_sum.NO_FAULTS,
) -> dict[str, Any]:
    """Unmask the round's sum, update the model, commit (a retry only re-sends), broadcast with
    the mean update (:func:`tasks.horizontal_party.verified_model`). ``faults``: tests only."""
    store, endpoint, job = side.store, side.endpoint, side.job
    cps = checkpoints(store, side.job_id)
    with store.session():
        saved = cps.find(round_)  # committed before a retry: only re-send
        if saved is None:
            saved = _unmask_and_update(side, round_, started, responders or list(side.parties))
            faults.crash_point(round_, "commit")
    message = {
        "round": round_,
        "weights": saved["weights"],
        "mean_update": saved["mean_update"],
        "survivors": saved["history"][-1]["survivors"],
        "revealers": saved.get("revealers"),
        "change": saved["change"],
    }
    rounds_coordinator.coordinator_relay_answers(
        endpoint, round_, message["survivors"], message["revealers"] or []
    )
    endpoint.send_many(list(job.parties), "model", message, round=round_)
    return saved["history"][-1]


def _unmask_and_update(
    side: Coordinator, round_: int, started: float, answered: list[str]
) -> dict[str, Any]:
    """The round's commit: the sum of ``answered``'s answers unmasked, the model moved by its
    mean update, the coordinator's new state and the round's checkpoint in one transaction."""
    store, job, options = side.store, side.job, side.options
    cps = checkpoints(store, side.job_id)
    responses = secure_sum.collect(side.endpoint, secure_rounds.RESPONSE, answered, round_, 0)
    previous = cps.load(round_ - 1) if round_ > 0 else None
    with store.transaction() as con:
        summed = rounds_coordinator.coordinator_unmask(store, job, round_, responses, con)
        if previous is None:
            before, history = hlr.init_model(n_features(job)), []
        else:
            before, history = np.asarray(previous["weights"]), previous["history"]
        mean = hlr.round_mean(summed.total, before, options.l2, dp_clip(options))
        weights = hlr.next_model(before, mean.mean, options.local_epochs, options.learning_rate)
        entry = {
            "round": round_,
            "loss": mean.mean_loss,
            "seconds": round(time.time() - started, 3),
            "started_at": started,  # the round's period is from one start to the next
            "survivors": summed.senders,
            "change": float(np.max(np.abs(weights - before))),
            "attempt": current_attempt(),  # the rounds table says who ran the round
        }
        if (noise := dp_noise(options, job)) is not None:  # the loss is noisy: by how much
            entry["loss_sd"] = hlr.dp_loss_sd(noise.share_sigma, len(summed.senders),
                                              mean.total_weight, options.dp_clip_norm,
                                              job.scale_bits)  # fmt: skip
        saved = {
            "weights": weights,
            "mean_update": mean.mean,
            "change": entry["change"],
            "history": [*history, entry],
            "revealers": summed.responders,
        }
        also = [cps.item(round_, saved)]
        secure_rounds.save_record(store, job, COORDINATOR, summed.record, con, also=also)
    rounds_coordinator.remember(store, job, summed.record)
    run_logger().info(
        "round %d: loss %.6f from %d parties", round_, entry["loss"], len(summed.senders)
    )
    return saved


@task(
    name="hlr-resend-model",
    task_run_name="round {round_}: coordinator re-sends the model",
    **PARTY_STEP,
)
def resend_model(side: Coordinator, round_: int) -> dict[str, Any]:
    """A restarted coordinator: the committed round's result again (a party may lack it)."""
    return _commit_round(side, round_, time.time(), None)


# ---------------------------------------------------------------------------------------------
# After the last round


def stop_parties(side: Coordinator, round_: int) -> None:
    """After the last round: the stop, then shred the coordinator's secrets."""
    _call_round(side, round_, stop=True)
    rounds_coordinator.forget(side.store, side.job)


@task(name="hlr-coordinator-model", task_run_name="coordinator: store model", **PARTY_STEP)
def coordinator_model(side: Coordinator) -> dict[str, Any]:
    """Save the final model in the coordinator's store; return it with the round history."""
    store, job_id = side.store, side.job_id
    artifacts, cps = ArtifactStore(store), checkpoints(store, job_id)
    last = cps.last_round()
    if last < 0:
        raise RoundStateError(f"coordinator: job {job_id} stopped before any round finished")
    saved = cps.load(last)
    fitted = stored_fitted(str(store.path), job_id)
    schema = artifacts.get(_schema_key(job_id))
    if schema is None:
        raise RoundStateError(f"coordinator: no agreed schema for job {job_id}")
    features = trained_columns(fitted, schema["feature_columns"])
    model = model_record(job_id, features, saved["weights"], last + 1, fitted and fitted.to_dict())
    if fitted is not None:  # the pooled training rows, summed in the clear for preprocessing
        model["rows"] = {"train": fitted.rows}
    artifacts.put(model_key(job_id), model, "model")
    cps.prune(keep_last=2)
    return {**model, "weights": model_weights(model).tolist(), "history": saved["history"]}
