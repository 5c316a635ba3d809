"""Flow ``vertical_lr``: logistic regression on features split across parties (Paillier).

    hosts ── [[Xh wh / 4]] ──▶ guest ── [[d]] (re-randomised) ──▶ hosts
    guest, hosts ── [[X^T d]] + own mask ──▶ key holder ── X^T d + mask ──▶ owner
    guest ── [[Taylor loss]] ──▶ key holder ── loss ──▶ early stopping
    every party: unmask, step, checkpoint the round           (repeat per mini-batch)

The key holder is an arbiter, or the guest itself with ``arbiter=False`` (seed 003's
two-party mode; see the README for what each side learns then).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from prefect.states import Completed, State

from core import test_switches
from core.outcomes import BELOW_BASELINE, check_loss, classifier_verdict
from core.paillier.keys import check_key_size
from core.paillier.randomness import DEFAULT_RANDOMIZER, randomizer_mode
from core.preprocessing import PreprocessingSpec
from core.vertical_lr.schedule import Schedule
from storage.descriptor import TableRef
from storage.workspace import derive_job_id, workspace_root
from tasks import vertical_lr as steps
from tasks.charts import own_rows_roc, publish_training_charts
from tasks.loading import fingerprint
from tasks.reporting import Progress, artifact_key, publish_model_link, publish_table, run_namer
from tasks.summaries import current_attempt, vertical_round_history, vertical_summary

FAULT_VARIABLE = test_switches.FAIL_ROUND_VARIABLE
"""Tests only: ``PRIVREG_TEST_FAIL_ROUND=<job id>:<round>`` in the environment of the process
that runs the one-process flow makes that job's round fail on the flow run's first try (past
the round's own retries); a retry of the flow run passes (see :mod:`core.test_switches`)."""


class InjectedFaultError(RuntimeError):
    """Raised by the test-only fault switch (:data:`FAULT_VARIABLE`)."""


def _injected_fault(job_id: str, round_: int) -> bool:
    return test_switches.fail_round(job_id) == round_ and flow_run.run_count <= 1


@task(name="vertical-round", task_run_name="round {round_}", retries=1, retry_delay_seconds=2)
def train_round(
    job: steps.VerticalJob, guest: TableRef, hosts: list[TableRef], round_: int
) -> dict[str, Any]:
    """One mini-batch, every party's steps; re-running it recomputes the round whole."""
    started = time.perf_counter()
    for host in hosts:
        steps.host_forward(job, host, round_)
    for host in hosts[1:]:
        steps.host_cross_terms(job, host, round_)
    steps.guest_residual(job, guest, round_)
    for host in hosts:
        steps.host_gradient(job, host, round_)
    loss = steps.key_holder_decrypt(job, round_)
    if _injected_fault(job.job_id, round_):  # every attempt of the first try: past retries
        raise InjectedFaultError(f"injected fault in round {round_} ({FAULT_VARIABLE})")
    squared = steps.update_weights(job, guest, round_, "guest")
    squared += sum(steps.update_weights(job, host, round_, "host") for host in hosts)
    metrics = {
        "gradient_norm": squared**0.5,
        "seconds": time.perf_counter() - started,
        "attempt": current_attempt(),  # the rounds table says which attempt ran the round
    }
    steps.record_round(job, job.key_holder_database, round_, loss, metrics)
    return {"loss": loss, **metrics}


@task(name="vertical-holdout", task_run_name="epoch {epoch} hold-out loss")
def holdout_loss(
    job: steps.VerticalJob, guest: TableRef, hosts: list[TableRef], round_: int, epoch: int
) -> float:
    """Seed 001's hold-out check: the encrypted Taylor loss of the held-out rows."""
    for host in hosts:
        steps.host_forward(job, host, round_, "holdout")
    for host in hosts[1:]:
        steps.host_cross_terms(job, host, round_, "holdout")
    steps.guest_residual(job, guest, round_, "holdout")
    return steps.key_holder_decrypt(job, round_, "holdout")


@flow(name="vertical_lr", flow_run_name=run_namer("vertical_lr"))
def vertical_lr(
    guest: dict[str, Any],
    hosts: list[dict[str, Any]],
    epochs: int = 5,
    batch_size: int = 1024,
    learning_rate: float = 0.15,
    momentum: float = 0.9,
    decay: float = 0.0,
    l2: float = 0.0,
    tol: float = 1e-5,
    key_size: int = 2048,
    seed: int = 0,
    holdout_fraction: float = 0.1,
    arbiter: bool = True,
    arbiter_database: str | None = None,
    workspace: str | None = None,
    job_id: str | None = None,
    randomizer: str = DEFAULT_RANDOMIZER,
    clip_features: float | None = None,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any] | State:
    """Train; returns the guest's slice (its coefficients, metrics, scores table) and the
    round history. Each host's coefficients stay in its own store (``models/vertical/...``).

    ``job_id`` defaults to one derived from the tables' salted fingerprints and every
    option except ``epochs`` (so a run with more epochs continues the same job).
    ``clip_features`` clips every party's features to [-c, c] locally (standardised data).
    ``randomizer`` picks the Paillier obfuscators: ``"full"`` (default: fixed-base h_s^r with
    r < n, semantically secure under DCR alone), ``"short"`` (``"djn"``: r of k/2 bits, about
    1.6x cheaper, needs an extra short-exponent assumption) or ``"standard"`` (textbook r^n,
    slowest); see core/paillier/randomness.py for the security statement.

    Args:
        guest: Descriptor of the guest's aligned table (holds the labels and some features).
        hosts: Descriptors of the hosts' aligned tables (features only), one per host.
        epochs: Passes over the training rows; more epochs on the same job continue it.
        batch_size: Rows per mini-batch (one protocol round per batch).
        learning_rate: Step size of the momentum gradient descent.
        momentum: Momentum of the gradient descent (0 for plain steps).
        decay: Learning-rate decay per epoch.
        l2: L2 penalty on the coefficients.
        tol: Stop once an epoch's mean loss changes by less than this.
        key_size: Paillier modulus bits (2048 by default; smaller only for tests).
        seed: Seed of the public batch schedule and hold-out split.
        holdout_fraction: Share of rows held out for the hold-out loss and metrics.
        arbiter: Let an arbiter hold the key (False: the guest holds it, two-party mode).
        arbiter_database: The arbiter's database (default: under the workspace).
        workspace: Folder for run messages and the arbiter (default: var or PRIVREG_HOME).
        job_id: Job to continue; default derived from the tables and options. Give the id
            a key and pools were prepared for ahead of the run (``privreg paillier``).
        randomizer: Paillier obfuscators: "full" (default), "short" (also "djn": about 1.6x
            cheaper, an extra assumption) or "standard" (textbook, slowest).
        clip_features: Clip every party's features to [-c, c] locally; None keeps them.
        preprocessing: The job's preprocessing (scaling, imputation; default: standardise):
            each party fits it on its own columns, nothing leaves it.

    A loss that becomes non-finite or rises far above the first round's stops the run with
    ``DivergenceError``; a model no better than the class prior on held-out rows ends in the
    COMPLETED state named "Below baseline" (its result is the same dictionary).
    """
    logger = get_run_logger()
    randomizer_mode(randomizer)  # an unknown name fails here, before any key is made
    check_key_size(key_size)  # below 2048 bits: this process's opt-in (tests only)
    spec = PreprocessingSpec.from_dict(preprocessing)
    guest_ref = TableRef.from_dict(guest)
    host_refs = [TableRef.from_dict(h) for h in hosts]
    if not host_refs:
        raise steps.VerticalSetupError("vertical_lr needs at least one host")
    if not arbiter and len(host_refs) != 1:
        raise steps.VerticalSetupError("two-party mode (arbiter=False) takes exactly one host")
    names = [guest_ref.party, *[h.party for h in host_refs]]
    if len(set(names)) != len(names) or "arbiter" in names:
        raise steps.VerticalSetupError(f"party names must be distinct and not 'arbiter': {names}")
    options = {
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "momentum": momentum,
        "decay": decay,
        "l2": l2,
        "key_size": key_size,
        "seed": seed,
        "holdout_fraction": holdout_fraction,
        "arbiter": arbiter,
        "randomizer": randomizer,
        "clip_features": clip_features,
        "preprocessing": spec.to_dict(),
    }
    if job_id is None:
        job_id = derive_job_id(
            "vertical",
            {
                "tables": [[r.party, r.table, fingerprint(r)] for r in (guest_ref, *host_refs)],
                **options,
            },
        )
    key_holder_db = arbiter_database or str(
        workspace_root(workspace) / "parties" / "arbiter.duckdb"
    )
    # Set-up: keys, checks, alignment.
    provisional = steps.VerticalJob(
        job_id=job_id,
        workspace=workspace,
        guest=guest_ref.party,
        hosts=tuple(h.party for h in host_refs),
        key_holder="arbiter" if arbiter else guest_ref.party,
        key_holder_database=key_holder_db if arbiter else guest_ref.database,
        schedule=Schedule(2, 1, seed),
        learning_rate=learning_rate,
        momentum=momentum,
        decay=decay,
        l2=l2,
        randomizer=randomizer,
        clip_features=clip_features,
        preprocessing=spec,
        key_size=key_size,
    )
    info = steps.check_party(provisional, guest_ref, "guest")
    host_features = {
        h.party: steps.check_party(provisional, h, "host")["features"] for h in host_refs
    }
    steps.check_alignment(provisional, guest_ref)
    schedule = Schedule(info["rows"], min(batch_size, info["rows"]), seed, holdout_fraction)
    steps.check_batches(schedule, host_features)  # the guest refuses batches that leak labels
    widths = ((guest_ref.party, info["features"] + 1), *host_features.items())
    job = dataclasses.replace(provisional, schedule=schedule, widths=widths)
    steps.create_keys(job, key_size)
    # Resume: the smallest last round any party finished; parties ahead roll back.
    finished = [steps.last_round(job, r) for r in (guest_ref, *host_refs)]
    resume_from = min(finished)
    for ref, last in zip((guest_ref, *host_refs), finished, strict=True):
        if last > resume_from:
            steps.rollback(job, ref, resume_from)
    stopped = steps.stopped_at(job)
    total_rounds = epochs * schedule.batches_per_epoch
    if resume_from >= 0:
        logger.info("job %s: resuming after round %d", job_id, resume_from)
    if stopped is None and resume_from + 1 < total_rounds and steps.key_retired(job):
        raise steps.KeyHolderRefusalError(
            f"job {job_id} has ended and its key holder deleted the private key, so it cannot "
            f"train past round {resume_from}: start a new job (another job_id) to train longer"
        )
    history: list[dict[str, Any]] = []
    progress = Progress(total_rounds, f"vertical_lr {job_id}")
    last_done = resume_from
    first_loss = steps.stored_losses(job, job.key_holder_database).get(0)
    for round_ in range(resume_from + 1, total_rounds if stopped is None else 0):
        result = train_round(job, guest_ref, host_refs, round_)
        first_loss = result["loss"] if first_loss is None else first_loss
        check_loss("vertical_lr", job_id, round_, result["loss"], first_loss)
        epoch, index = schedule.position(round_)
        history.append({"round": round_, "epoch": epoch, "batch": index, **result})
        progress.update(round_ + 1)
        last_done = round_
        if index == schedule.batches_per_epoch - 1:
            losses = steps.stored_losses(job, job.key_holder_database)  # earlier runs' too
            history[-1]["epoch_loss"] = steps.epoch_loss(losses, epoch, schedule.batches_per_epoch)
            if len(schedule.holdout_rows):
                history[-1]["holdout_loss"] = holdout_loss(job, guest_ref, host_refs, round_, epoch)
            if steps.decide_stop(job, round_, tol):
                break
    final_round = stopped if stopped is not None else last_done
    history_rows = vertical_round_history(job, workspace)
    publish_table(  # every finished round of the job, including those of earlier attempts
        artifact_key("vertical-lr", job_id, "rounds"),
        history_rows,
        f"vertical_lr rounds of job {job_id} (every attempt)",
    )
    guest_model = steps.save_model(job, guest_ref, final_round, "guest")
    for host in host_refs:  # each host's slice stays in its own store
        steps.save_model(job, host, final_round, "host")
        steps.host_scores(job, host)
    prediction = steps.guest_predict(job, guest_ref)
    steps.retire_key(job)  # no decryption is left to do in this job
    publish_model_link(
        artifact_key("vertical-lr", job_id, "model"), guest_ref.database, guest_model["key"]
    )
    verdict = classifier_verdict(prediction["metrics"])
    outcome_line = f"{BELOW_BASELINE}: {verdict.line}" if verdict.below_baseline else "trained"
    vertical_summary(
        job,
        guest_ref,
        host_refs,
        prediction["metrics"],
        len(history),
        workspace,
        history_rows,
        outcome=outcome_line,
    )
    rows = (schedule.train_rows, schedule.holdout_rows)
    roc = own_rows_roc(guest_ref, prediction["probabilities"], *rows)
    publish_training_charts("vertical-lr", job_id, [r["loss"] for r in history_rows], roc)
    guest_coefficients = dict(guest_model["coefficients"])
    # The guest's slice only: hosts' coefficients stay in their stores (models/vertical/...).
    outcome = {
        "job_id": job_id,
        "rounds_run": len(history),
        "resumed_from": resume_from,
        "final_round": final_round,
        "party": guest_ref.party,
        "intercept": guest_coefficients.pop("intercept"),
        "coefficients": guest_coefficients,
        "metrics": prediction["metrics"],
        "scores_table": prediction["scores_table"],
        "history": history,
        "losses": [v for _, v in sorted(steps.stored_losses(job, job.key_holder_database).items())],
        "model_key": guest_model["key"],
        "database": str(Path(guest_ref.database)),
        "outcome": outcome_line,
    }
    if verdict.below_baseline:  # still COMPLETED, visibly not a usable model
        logger.warning("vertical_lr %s: %s", job_id, outcome_line)
        return Completed(name=BELOW_BASELINE, message=outcome_line, data=outcome)
    return outcome
