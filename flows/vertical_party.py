"""Flow ``vertical_lr_party``: one party's side of vertical LR, run at its own organisation.

    guest                          host h                          key holder (arbiter)
    check table   ◀── id digest, feature count                     key pair ── n ──▶ all
    agree         ── rows ──▶                ── rows, gradient lengths ──▶
    each round r:
                  ◀── [[Xh wh/4]], [[sum a^2]]
    [[d]], [[loss]] ── [[d]] ──▶
                  ── [[X^T d]] + mask, [[loss]] ─────────────────────────▶ decrypt
                                             ── [[Xh^T d]] + mask ──────▶
                  ◀── X^T d + mask, loss ──────────────────────────────── (to each owner)
    unmask, step, checkpoint                 unmask, step, checkpoint
    epoch end: hold-out loss; the key holder's stop decision ──▶ every party
    end: hosts ── score shares ──▶ guest; the key holder deletes p, q

More (the protocol, what each party learns, why): docs/protocols/vertical-lr.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.runtime import flow_run
from prefect.states import Completed, State

from core import test_switches
from core.job_schema import VerticalOptions
from core.outcomes import BELOW_BASELINE, check_loss, classifier_verdict
from core.paillier.keys import check_key_size
from core.preprocessing import PreprocessingSpec
from core.vertical_lr.schedule import Schedule
from federation.party_config import active_config
from federation.workspace import channel_for
from flows.local_run import caller_attempt
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import vertical_lr as steps
from tasks.charts import own_rows_roc, publish_training_charts
from tasks.policy import PARTY_STEP
from tasks.reporting import artifact_key, flow_short, publish_model_link, publish_table
from tasks.summaries import current_attempt, vertical_round_history, vertical_summary

ROLES = ("guest", "host", "arbiter")

FAULT_VARIABLE = test_switches.FAIL_ROUND_VARIABLE
"""Tests only: ``PRIVREG_TEST_FAIL_ROUND=<job id>:<round>`` in the environment of the process
that runs the guest makes that job's round fail at the guest on the first try of its run (or of
the local run that started it), past the round's own retries (see :mod:`core.test_switches`)."""


class InjectedFaultError(RuntimeError):
    """Raised by the test-only fault switch (:data:`FAULT_VARIABLE`)."""


def _injected_fault(job_id: str, round_: int) -> bool:
    first_try = (flow_run.run_count or 1) <= 1 and caller_attempt() <= 1
    return test_switches.fail_round(job_id) == round_ and first_try


@flow(name="vertical_lr_party", flow_run_name="vertical_lr {job_id}: {role}")
def vertical_lr_party(
    role: str,
    job_id: str,
    guest: str,
    hosts: list[str],
    options: VerticalOptions,
    own: dict[str, Any] | None = None,
    arbiter: str = "arbiter",
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any] | State:
    """Run one party's steps of a vertical LR job; the result names only this party's slice.

    Args:
        role: "guest" (labels), "host" (features only) or "arbiter" (holds the key).
        job_id: Job name every party agreed on (resumes the job when it exists).
        guest: The guest's party name.
        hosts: The hosts' party names, in the same order at every party.
        options: The training's options (every party passes the same); with
            ``options.arbiter`` false the guest holds the key (two-party mode).
        own: Descriptor of this party's own aligned table (none for the arbiter).
        arbiter: The arbiter's party name (unused in two-party mode).
        preprocessing: The job's preprocessing (default: standardise); this party fits it on
            its own columns only, nothing leaves it. Every party passes the job's same object.
    """
    o = options
    key_holder = arbiter if o.arbiter else None
    check_key_size(o.key_size)  # below 2048 bits: this party's own opt-in (tests only)
    ref = _own_table(role, own, guest, hosts, key_holder)
    job = steps.VerticalJob(
        job_id=job_id,
        channel=channel_for(job_id),  # this side's, built once and handed down
        guest=guest,
        hosts=tuple(hosts),
        key_holder=key_holder or guest,
        key_holder_database=_key_holder_database(role, ref, key_holder, o.arbiter_database),
        schedule=Schedule(2, 1, o.seed),  # the real one once the guest has told the row count
        learning_rate=o.learning_rate,
        momentum=o.momentum,
        decay=o.decay,
        l2=o.l2,
        randomizer=o.randomizer,
        clip_features=o.clip_features,
        preprocessing=PreprocessingSpec.from_dict(preprocessing),
        key_size=o.key_size,
    )
    shape = {"batch_size": o.batch_size, "holdout_fraction": o.holdout_fraction}
    started = time.time()
    if ref is None:
        steps.create_keys(job, o.key_size)
        with PartyStore(job.key_holder_database).session():  # held through the job
            result = _arbiter(steps.receive_setup(job, job.key_holder, **shape), o.epochs, o.tol)
    elif role == "host":
        with PartyStore.of(ref).session():  # held through the job: no opening per step
            result = _host(_host_setup(job, ref, shape), ref, o.epochs)
    else:
        with PartyStore.of(ref).session():
            info = steps.check_party(job, ref, "guest")
            for host in job.hosts:  # each sends both, one right after the other
                steps.prefetch(job, ref.party, host, "id_order_digest")
                steps.prefetch(job, ref.party, host, "features")
            steps.check_alignment(job, ref)
            job = steps.guest_agree(job, ref, info, **shape)
            if not job.with_arbiter:
                steps.create_keys(job, o.key_size)
            result = _guest(job, ref, o.epochs, o.tol)
    result = {**result, "started_at": started, "finished_at": time.time()}
    if str(result.get("outcome", "")).startswith(BELOW_BASELINE):  # COMPLETED, named so
        return Completed(name=BELOW_BASELINE, message=result["outcome"], data=result)
    return result


def _own_table(
    role: str, own: dict[str, Any] | None, guest: str, hosts: list[str], arbiter: str | None
) -> TableRef | None:
    """This party's table (None for the arbiter), refused when it does not fit the role."""
    if role not in ROLES or (role == "arbiter") != (own is None):
        raise steps.VerticalSetupError(
            f"role {role!r} must be one of {ROLES}; the guest and hosts give their own table, "
            "the arbiter none"
        )
    if not hosts or (arbiter is None and len(hosts) != 1):
        raise steps.VerticalSetupError("vertical LR takes one or more hosts (one without arbiter)")
    names = [guest, *hosts, *([arbiter] if arbiter else [])]
    if len(set(names)) != len(names):
        raise steps.VerticalSetupError(f"party names must be distinct: {names}")
    ref = TableRef.from_dict(own) if own is not None else None
    if ref is not None and ref.party != guest and role == "guest":
        raise steps.VerticalSetupError(f"the guest is {guest!r}, this table is {ref.party!r}'s")
    if ref is not None and ref.party not in hosts and role == "host":
        raise steps.VerticalSetupError(f"{ref.party!r} is not one of the hosts {hosts}")
    return ref


def _key_holder_database(
    role: str, ref: TableRef | None, arbiter: str | None, database: str | None
) -> str:
    """The key holder's own store: the arbiter's database, or the guest's in two-party mode.
    Other parties never open it (an empty name)."""
    if role == "guest" and arbiter is None:
        assert ref is not None
        return ref.database
    if role != "arbiter":
        return ""
    config = active_config()
    if config is None:
        raise steps.VerticalSetupError("the arbiter runs as a party (a local run or its own)")
    home = config.root / "parties" if config.local else config.root
    return database or str(Path(home) / f"{arbiter}.duckdb")


def _result(
    job: steps.VerticalJob, party: str, role: str, rounds: int, last: int, final: int, **more: Any
) -> dict[str, Any]:
    """What every party's side returns (its own slice only), then ``more`` of its own."""
    return {
        "job_id": job.job_id,
        "party": party,
        "role": role,
        "rounds_run": rounds,
        "resumed_from": last,
        "final_round": final,
        **more,
    }


class _Plain:
    """The steps as plain calls: inside a party's round task they are not task runs of
    their own (what a round runs is in its task run's logs)."""

    def __getattr__(self, name: str) -> Any:
        step = getattr(steps, name)
        return getattr(step, "fn", step)


inner = _Plain()


@task(name="vertical-party-round", task_run_name="round {round_}: {party}", **PARTY_STEP)
def _party_round(party: str, round_: int, body: Callable[[], bool]) -> bool:
    """One party's round of the job and, after an epoch's last round, the epoch's end; the
    key holder's stop decision. Every step in it is idempotent (re-sent messages are the
    stored bytes), so a retry re-runs the round whole."""
    return body()


def _run_rounds(
    job: steps.VerticalJob,
    party: str,
    last: int,
    epochs: int,
    round_body: Callable[[int], None],
    epoch_end: Callable[[int], bool],
    after: Callable[[int], None] = lambda _: None,
) -> int:
    """Run this party's rounds after its last checkpoint, up to ``epochs`` or the key holder's
    stop (``epoch_end``'s return), each with its epoch's end as one task run, then ``after``.
    Restarted right after an epoch's last round, it redoes that epoch's end first (idempotent:
    messages are re-sent byte for byte). Returns how many rounds ran."""
    total = epochs * job.schedule.batches_per_epoch
    redo_epoch_end = last >= 0 and _is_epoch_end(job, last)
    if total == 0 or (redo_epoch_end and _party_round(party, last, lambda: epoch_end(last))):
        return 0

    def whole(round_: int) -> bool:
        round_body(round_)
        return _is_epoch_end(job, round_) and epoch_end(round_)

    ran = 0
    for round_ in range(last + 1, total):
        stop = _party_round(party, round_, lambda r=round_: whole(r))
        after(round_)
        ran += 1
        if stop:
            break
    return ran


def _is_epoch_end(job: steps.VerticalJob, round_: int) -> bool:
    return job.schedule.position(round_)[1] == job.schedule.batches_per_epoch - 1


def _draws_after(job: steps.VerticalJob, role: str, round_: int, epochs: int) -> int:
    """Obfuscators a party draws after this round's gradient (the hold-out step's at an epoch's
    end, then the next round's), computed while it waits for the key holder's decryption."""
    schedule = job.schedule
    count = 0
    if _is_epoch_end(job, round_) and len(schedule.holdout_rows):
        count += (len(schedule.holdout_rows) if role == "host" else 0) + 1
    if round_ + 1 < epochs * schedule.batches_per_epoch:
        count += len(schedule.batch(*schedule.position(round_ + 1))) + 1
    return count


# ---- the key holder (the arbiter, or the guest in two-party mode) ------------------------------
def _decrypt_round(job: steps.VerticalJob, round_: int) -> None:
    inner.share_loss(job, round_, "train", inner.key_holder_decrypt(job, round_))


def _key_holder_epoch_end(job: steps.VerticalJob, round_: int, tol: float) -> bool:
    if len(job.schedule.holdout_rows):
        holdout = inner.key_holder_decrypt(job, round_, "holdout")
        inner.share_loss(job, round_, "holdout", holdout)
    return inner.decide_stop(job, round_, tol, tell=True)


def _check_loss(job: steps.VerticalJob, database: str, round_: int) -> None:
    """A diverging loss ends the run (the round's as stored in ``database``, and round 0's)."""
    loss, first = steps.round_losses(job, database, round_, 0)
    check_loss("vertical_lr", job.job_id, round_, loss, first)


def _check_key(job: steps.VerticalJob, last: int, epochs: int) -> bool:
    """False when the job has ended (the key is deleted and nothing is left to decrypt)."""
    if not steps.job_key_pair(job).retired():  # p, q are not yet destroyed
        return True
    if steps.stopped_at(job) is None and last + 1 < epochs * job.schedule.batches_per_epoch:
        raise steps.KeyHolderRefusalError(
            f"job {job.job_id} has ended and its key holder deleted the private key, so it cannot "
            f"train past round {last}: start a new job (another job_id) to train longer"
        )
    return False


def _arbiter(job: steps.VerticalJob, epochs: int, tol: float) -> dict[str, Any]:
    last = steps.key_holder_last_round(job)
    rounds = 0
    if _check_key(job, last, epochs):
        rounds = _run_rounds(
            job,
            job.key_holder,
            last,
            epochs,
            lambda r: _decrypt_round(job, r),
            lambda r: _key_holder_epoch_end(job, r, tol),
            lambda r: _check_loss(job, job.key_holder_database, r),
        )
        steps.retire_key(job)  # no decryption is left to do in this job
    return _result(job, job.key_holder, "arbiter", rounds, last, steps.key_holder_last_round(job))


# ---- a host ------------------------------------------------------------------------------------
def _host_setup(job: steps.VerticalJob, ref: TableRef, shape: dict[str, Any]) -> steps.VerticalJob:
    info = steps.check_party(job, ref, "host")
    steps.host_announce(job, ref, info["features"])
    job = steps.receive_setup(job, ref.party, **shape)
    if job.schedule.n_rows != info["rows"]:
        raise steps.VerticalSetupError(
            f"host {ref.party} has {info['rows']} rows, the guest {job.schedule.n_rows}"
        )
    return job


def _host_round(
    job: steps.VerticalJob, ref: TableRef, round_: int, phase: str = "train", ahead: int = 0
) -> None:
    inner.host_forward(job, ref, round_, phase)  # and the cross terms with earlier hosts
    if phase == "train":
        inner.host_gradient(job, ref, round_)
        inner.obfuscators_ahead(job, ref, ahead)  # while the key holder decrypts
        inner.update_weights(job, ref, round_, "host")


def _host_epoch_end(job: steps.VerticalJob, ref: TableRef, round_: int) -> bool:
    if len(job.schedule.holdout_rows):
        _host_round(job, ref, round_, "holdout")
    return inner.receive_stop(job, ref.party, round_)


def _host(job: steps.VerticalJob, ref: TableRef, epochs: int) -> dict[str, Any]:
    last = steps.last_round(job, ref)
    ended = steps.model_round(job, ref) is not None  # a finished job: re-send the scores only
    to_run = 0 if ended else epochs
    steps.plan_obfuscators(job, ref, to_run)
    rounds = _run_rounds(
        job,
        ref.party,
        last,
        to_run,
        lambda r: _host_round(job, ref, r, ahead=_draws_after(job, "host", r, epochs)),
        lambda r: _host_epoch_end(job, ref, r),
    )
    final = steps.last_round(job, ref)
    model = steps.save_model(job, ref, final, "host")  # the host's slice stays in its store
    steps.host_scores(job, ref)
    return _result(
        job, ref.party, "host", rounds, last, final, model_key=model["key"], database=ref.database
    )


# ---- the guest ---------------------------------------------------------------------------------
def _guest_round(
    job: steps.VerticalJob, ref: TableRef, round_: int, ahead: int = 0
) -> dict[str, Any]:
    """One mini-batch at the guest (plus the key holder's decryption in two-party mode). Its
    gradient norm is the guest's own slice's: the hosts' norms never reach it."""
    started = time.perf_counter()
    inner.guest_residual(job, ref, round_)
    if not job.with_arbiter:
        _decrypt_round(job, round_)
    if _injected_fault(job.job_id, round_):  # every attempt of the first try: past retries
        raise InjectedFaultError(f"injected fault in round {round_} ({FAULT_VARIABLE})")
    inner.obfuscators_ahead(job, ref, ahead)  # while the key holder decrypts
    # the key holder sends the loss right after the gradient: fetched with it
    steps.prefetch(job, ref.party, job.key_holder, "loss_value_train", round_)
    squared = inner.update_weights(job, ref, round_, "guest")
    metrics = {
        "gradient_norm": squared**0.5,
        "seconds": time.perf_counter() - started,
        "attempt": current_attempt(),  # the rounds table says which attempt ran the round
    }
    loss = inner.guest_loss(job, ref, round_, "train", metrics)
    epoch, index = job.schedule.position(round_)
    return {"round": round_, "epoch": epoch, "batch": index, "loss": loss, **metrics}


def _guest_epoch_end(
    job: steps.VerticalJob, ref: TableRef, round_: int, tol: float, record: dict[str, Any]
) -> bool:
    holdout = len(job.schedule.holdout_rows) > 0
    epoch, _ = job.schedule.position(round_)
    losses = steps.stored_losses(job, ref.database)
    record["epoch_loss"] = steps.epoch_loss(losses, epoch, job.schedule.batches_per_epoch)
    if holdout:
        inner.guest_residual(job, ref, round_, "holdout")
    stop = None if job.with_arbiter else _key_holder_epoch_end(job, round_, tol)
    if holdout:
        if job.with_arbiter:  # sent right after the hold-out loss: fetched with it
            steps.prefetch(job, ref.party, job.key_holder, "stop", round_)
        record["holdout_loss"] = inner.guest_loss(job, ref, round_, "holdout", {})
    return stop if stop is not None else inner.receive_stop(job, ref.party, round_)


def _guest(job: steps.VerticalJob, ref: TableRef, epochs: int, tol: float) -> dict[str, Any]:
    last = steps.last_round(job, ref)
    ended = steps.model_round(job, ref) is not None or (
        not job.with_arbiter and not _check_key(job, last, epochs)
    )
    history: list[dict[str, Any]] = []

    def epoch_end(round_: int) -> bool:
        record = history[-1] if history and history[-1]["round"] == round_ else {}
        return _guest_epoch_end(job, ref, round_, tol, record)

    def round_body(round_: int) -> None:
        if history and history[-1]["round"] == round_:  # a retried round replaces its record
            history.pop()
        history.append(_guest_round(job, ref, round_, _draws_after(job, "guest", round_, epochs)))

    to_run = 0 if ended else epochs
    steps.plan_obfuscators(job, ref, to_run)
    first = steps.round_losses(job, ref.database, 0)[0]

    def checked(round_: int) -> None:  # the loss it was sent, in memory: no read per round
        nonlocal first
        first = history[-1]["loss"] if first is None else first
        check_loss("vertical_lr", job.job_id, round_, history[-1]["loss"], first)

    _run_rounds(job, ref.party, last, to_run, round_body, epoch_end, checked)
    final = steps.last_round(job, ref)
    # the guest's own record of the rounds: losses the key holder sent it, its own metrics
    own_record = replace(job, key_holder_database=ref.database)
    history_rows = vertical_round_history(own_record)
    publish_table(
        artifact_key("vertical-lr", job.job_id, "rounds"),
        history_rows,
        f"vertical_lr rounds of job {job.job_id} (every attempt)",
    )
    model = steps.save_model(job, ref, final, "guest")
    prediction = steps.guest_predict(job, ref)
    if not job.with_arbiter:
        steps.retire_key(job)
    publish_model_link(artifact_key("vertical-lr", job.job_id, "model"), ref.database, model["key"])
    verdict = classifier_verdict(prediction["metrics"])
    outcome = f"{BELOW_BASELINE}: {verdict.line}" if verdict.below_baseline else "trained"
    vertical_summary(
        own_record,
        ref,
        [],
        prediction["metrics"],
        len(history),
        history_rows,
        outcome=outcome,
    )
    rows = (job.schedule.train_rows, job.schedule.holdout_rows)
    roc = own_rows_roc(ref, prediction["probabilities"], *rows)  # at the guest, its labels
    held_out = {
        r["round"]: r["held-out loss"] for r in history_rows if r.get("held-out loss") is not None
    }
    losses = [r["loss"] for r in history_rows]
    publish_training_charts(flow_short(), job.job_id, losses, roc, held_out)
    coefficients = dict(model["coefficients"])
    return {
        **_result(job, ref.party, "guest", len(history), last, final),
        "intercept": coefficients.pop("intercept"),
        "coefficients": coefficients,
        "metrics": prediction["metrics"],
        "scores_table": prediction["scores_table"],
        "history": history,
        "losses": [v for _, v in sorted(steps.stored_losses(job, ref.database).items())],
        "model_key": model["key"],
        "database": ref.database,
        "outcome": outcome,
    }
