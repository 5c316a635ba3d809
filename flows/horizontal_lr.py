"""Flow ``horizontal_lr``: logistic regression on rows spread over parties, by masked sums.

hospital:     check own table ──▶ column names ──▶ coordinator compares (once, before any round)
hospital:     job key ──▶ coordinator admits                (once per job, or a re-key)
then per round r:
coordinator:  call (active parties, their keys) ─▶ add masked ─▶ unmask sum, update, commit
hospital:                   mask update ─▶ answer unmask ─▶ check and save model

``horizontal_lr_party`` is a hospital's column, ``horizontal_lr_coordinator`` the
coordinator's; ``horizontal_lr`` runs them all in this process (:mod:`flows.hospitals`).
More (the protocol, what each party learns, why): docs/protocols/horizontal-lr.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed, State

from core import test_switches
from core.job_schema import HorizontalOptions
from core.outcomes import BELOW_BASELINE, check_loss, rising
from core.preprocessing import PreprocessingSpec
from federation.workspace import channel_for
from flows.hospitals import (
    agreed_threshold,
    hospital_names,
    hospital_tables,
    local_job_id,
    own_table,
    run_hospitals,
)
from flows.stage_options import keyword_options
from storage.descriptor import TableRef
from tasks import horizontal_coordinator as coordinator_steps
from tasks import horizontal_party as party_steps
from tasks import preprocessing as pre
from tasks.charts import publish_training_charts
from tasks.horizontal_lr import (
    check_dp,
    checkpoints,
    dp_terms,
    model_key,
    model_width,
    predict_proba,
)
from tasks.reporting import (
    Progress,
    artifact_key,
    flow_short,
    publish_model_link,
    publish_table,
    run_namer,
)
from tasks.secure_sum import COORDINATOR, Faults, SimulatedCrashError, coordinator_store
from tasks.summaries import horizontal_party_summary, horizontal_rounds, horizontal_summary

__all__ = [
    "SimulatedCrashError",
    "horizontal_lr",
    "horizontal_lr_coordinator",
    "horizontal_lr_party",
    "predict_proba",
]

#: The model's fields every side's result carries.
_MODEL_FIELDS = ("features", "coefficients", "intercept", "weights")


def _check_options(options: HorizontalOptions, names: list[str], spec: PreprocessingSpec) -> int:
    """What the schema cannot say alone: a hold-out below half, finite numbers, a safe
    threshold, what DP needs. Returns the threshold (default: a strict majority)."""
    if not options.holdout_fraction < 0.5:
        raise ValueError(f"holdout_fraction must be in [0, 0.5), got {options.holdout_fraction}")
    numbers = options.model_dump(include={"learning_rate", "l2", "stage_timeout"})
    if not all(math.isfinite(v) for v in numbers.values()):
        raise ValueError(f"options must be finite numbers, got {numbers}")
    threshold = agreed_threshold(options.threshold, names)
    check_dp(options, threshold, pre.needs_statistics(spec))
    return threshold


def _spec(preprocessing: dict[str, Any] | None) -> PreprocessingSpec:
    return pre.pooled_spec(preprocessing, "horizontal_lr", indicators=True)


@flow(name="horizontal_lr", flow_run_name=run_namer("horizontal_lr"))
@keyword_options(HorizontalOptions)
def horizontal_lr(
    parties: list[dict[str, Any]],
    workspace: str | None = None,
    job_id: str | None = None,
    preprocessing: dict[str, Any] | None = None,
    *,
    options: HorizontalOptions,
) -> dict[str, Any] | State:
    """Train logistic regression on the parties' rows; the coordinator sees only masked sums.

    Runs every hospital's and the coordinator's side flow in this process. ``seed`` only names
    the job: masks must come from fresh OS randomness. A diverging loss raises
    ``DivergenceError``; a model no better than the class prior on held-out rows ends in the
    COMPLETED state "Below baseline" carrying the same result. More:
    docs/protocols/horizontal-lr.md.

    Args:
        parties: Descriptors of every party's table (same columns, a label column each).
        workspace: Folder for the coordinator's store and the run's messages.
        job_id: Job to continue; default derived from the tables and options.
        preprocessing: The job's preprocessing (default: standardise with pooled statistics
            from one secure sum; see tasks/preprocessing.py for what the coordinator learns).
    """
    spec = _spec(preprocessing)
    refs = hospital_tables(parties)
    names = [ref.party for ref in refs]
    threshold = _check_options(options, names, spec)
    digests = [party_steps.check_table(ref) for ref in refs]  # every table, before any side
    if job_id is None:
        job_id = _derived_job_id(refs, digests, options, spec, threshold)
    agreed = (job_id, options, spec.to_dict())
    coordinator = functools.partial(horizontal_lr_coordinator, names, *agreed)
    hospitals = {
        r.party: functools.partial(horizontal_lr_party, r.to_dict(), names, *agreed) for r in refs
    }
    result, _ = run_hospitals(job_id, workspace, coordinator, hospitals)
    # this run plays every owner: one summary with each hospital's figures and the pooled ones
    summary = horizontal_summary(
        job_id, refs, result, result["rounds_run"], workspace, options.holdout_fraction
    )
    return _ended({**result, "model_key": model_key(job_id), "outcome": summary["outcome"]})


def _derived_job_id(
    refs: list[TableRef],
    digests: list[str],
    options: HorizontalOptions,
    spec: PreprocessingSpec,
    threshold: int,
) -> str:
    """The tables' salted digests and every option that shapes the model (not ``rounds`` or
    ``tol``): re-running resumes, and asking for more rounds continues."""
    shaping = options.model_dump(include={"local_epochs", "learning_rate", "l2"})
    shaping["preprocessing"] = spec.to_dict()
    if options.holdout_fraction:
        shaping["holdout_fraction"] = options.holdout_fraction
    shaping |= {"seed": options.seed, "threshold": threshold}
    if options.dp_epsilon is not None:  # calibrated for its rounds: a new job, not a continuation
        shaping["dp"] = dp_terms(options)
    return local_job_id("horizontal-lr", refs, digests, shaping)


def _ended(result: dict[str, Any]) -> dict[str, Any] | State:
    """The result, or the COMPLETED state named "Below baseline" carrying it."""
    if not str(result.get("outcome", "")).startswith(BELOW_BASELINE):
        return result
    get_run_logger().warning("horizontal_lr %s: %s", result["job_id"], result["outcome"])
    return Completed(name=BELOW_BASELINE, message=result["outcome"], data=result)


# ---------------------------------------------------------------------------------------------
# The coordinator's side


class _LossWatch:
    """The coordinator's view of the securely aggregated loss: it stops a diverging run
    (DivergenceError naming the round) and warns while the loss keeps rising."""

    def __init__(self, side: coordinator_steps.Coordinator, start: int) -> None:
        self.job_id, self.losses, self.warned = side.job_id, [], False
        if start > 0:  # resumed: the first round's loss is in the coordinator's checkpoint
            saved = checkpoints(side.store, side.job_id).load(start - 1)
            self.losses = [float(e["loss"]) for e in saved["history"]]

    def check(self, round_: int, loss: float, noise_sd: float = 0.0) -> None:
        """``noise_sd``: the DP noise the loss carries (0 without DP), never taken for a rise."""
        first = self.losses[0] if self.losses else None
        check_loss("horizontal_lr", self.job_id, round_, loss, first, noise_sd)
        self.losses.append(loss)
        if rising(self.losses, noise_sd=noise_sd) and not self.warned:
            self.warned = True
            get_run_logger().warning(
                "horizontal_lr %s: the aggregated loss rose in each of the last 3 rounds "
                "(%s); the learning rate may be too large for these features",
                self.job_id,
                ", ".join(f"{v:.4g}" for v in self.losses[-4:]),
            )


def _publish(side: coordinator_steps.Coordinator, model: dict[str, Any]) -> None:
    job_id = side.job_id
    short = job_id.removeprefix("horizontal-lr-")
    rows = horizontal_rounds(job_id, model["history"])  # as its own channel saw them
    publish_table(
        artifact_key("horizontal-lr", short, "rounds"),
        rows,
        f"horizontal_lr {job_id}: securely aggregated loss per round",
    )
    publish_model_link(
        artifact_key("horizontal-lr", short, "model"), side.store.path, model_key(job_id)
    )


@flow(name="horizontal_lr_coordinator", flow_run_name="horizontal_lr {job_id}: coordinator")
def horizontal_lr_coordinator(
    parties: list[str],
    job_id: str,
    options: HorizontalOptions,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The coordinator's side: call each round, run its secure-sum stages, update the model.

    A party silent past ``stage_timeout`` is dropped from the round while ``threshold``
    remain; a re-run with the same ``job_id`` resumes after the last committed round.

    Args:
        parties: Names of the hospitals (as their certificates name them).
        job_id: Job name agreed with every party.
        options: The training (every hospital passes the same; each checks the call's).
        preprocessing: The job's preprocessing (every hospital passes the same); pooled
            statistics come from secure sums before the first round.
    """
    spec = _spec(preprocessing)
    names = hospital_names(parties)
    threshold = _check_options(options, names, spec)
    endpoint = channel_for(job_id).endpoint(COORDINATOR)
    side = coordinator_steps.Coordinator(
        endpoint, coordinator_store(), tuple(names), threshold, options
    )
    opened = coordinator_steps.open_job(side)
    start, features = opened["last_round"] + 1, opened["features"]
    pre.coordinator_statistics(job_id, features, spec, names, threshold, options.stage_timeout)
    side = replace(side, width=model_width(str(side.store.path), job_id, features))
    rounds, tol = options.rounds, options.tol
    converged = opened["change"] is not None and opened["change"] < tol
    progress = Progress(rounds, f"horizontal_lr {job_id}: rounds finished")
    progress.update(rounds if converged else start)
    if start > 0:  # re-send the committed round's result: a party may not have it yet
        get_run_logger().info("job %s: resuming after round %d", job_id, start - 1)
        coordinator_steps.resend_model(side, start - 1)
    if start < rounds and not converged:  # the parties' keys, once per job
        coordinator_steps.refuse_if_stopped(side, start)
        coordinator_steps.admit_keys(side, start, opened["announced"])
    ran = 0
    watch = _LossWatch(side, start)
    faults = Faults.of_job(job_id, names, party_steps.STAGES)  # tests only; empty in production
    left_out: list[list[str]] = []  # per round run, who was not waited for
    with side.store.session():  # held through the rounds: no opening of it per step
        for round_ in range(start, rounds):
            if converged:
                break
            # one task run per round: call, masked inputs, unmasking, model
            done = coordinator_steps.coordinator_round(side, round_, faults)
            left_out.append(done["left_out"])
            entry = done["entry"]
            watch.check(round_, entry["loss"], entry.get("loss_sd", 0.0))
            ran, converged = ran + 1, entry["change"] < tol
            progress.update(rounds if converged else round_ + 1)
    model = coordinator_steps.coordinator_model(side)
    coordinator_steps.stop_parties(side, model["rounds"])
    _publish(side, model)
    # the securely aggregated loss only: the coordinator holds no labels, so no ROC here
    publish_training_charts(flow_short(), job_id, [e["loss"] for e in model["history"]])
    return {
        "job_id": job_id,
        **{k: model[k] for k in (*_MODEL_FIELDS, "history")},
        "dropped": [[p for p in names if p not in e["survivors"]] for e in model["history"]],
        "left_out": left_out,
        "preprocessing": model.get("preprocessing"),
        "rounds_completed": model["rounds"],
        "rounds_run": ran,
        "resumed_from": start,
        "converged": converged,
        "threshold": threshold,
    }


# ---------------------------------------------------------------------------------------------
# A hospital's side


@flow(name="horizontal_lr_party", flow_run_name="horizontal_lr {job_id}: {own[party]}")
def horizontal_lr_party(
    own: dict[str, Any],
    parties: list[str],
    job_id: str,
    options: HorizontalOptions,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One hospital's side: join, then per round contribute its masked update and check and
    save the coordinator's model, until the coordinator's stop.

    A re-run resumes after its last saved round; a round it already masked is re-sent from its
    own records, never masked twice. A call that states other options (bar this hospital's
    own ``holdout_fraction``) is refused.

    Args:
        own: Descriptor of this hospital's own table (with its label column).
        parties: Names of every hospital of the job, this one included.
        job_id: Job name agreed with the coordinator and the other hospitals.
        options: The training as agreed for the job, and this hospital's hold-out.
        preprocessing: The job's preprocessing (the coordinator's call must ask for the same).
    """
    spec = _spec(preprocessing)
    names = hospital_names(parties)
    ref = own_table(own, names)
    _check_options(options, names, spec)
    fault = test_switches.party_fault(job_id)  # tests only; None in production
    faults = Faults.of_job(job_id, names, party_steps.STAGES)  # tests only: fails or hangs
    endpoint = channel_for(job_id).endpoint(ref.party)
    party_steps.check_table(ref)
    first = party_steps.join_job(ref, endpoint)["last_round"] + 1
    features = party_steps.agreed_features(endpoint)
    pre.party_statistics(ref, job_id, features, spec, names, options.holdout_fraction)
    width = model_width(ref.database, job_id, features)  # missing indicators too
    side = party_steps.Hospital(ref, endpoint, tuple(names), tuple(features), width, options)
    # keys once per job, kept across a restart; under DP every round is charged first, once
    side = replace(side, dp_charge=party_steps.join_rounds(side, first))
    # the database held through the rounds: no opening of it per step (0.5 s and more under
    # load); another process wanting it (the CLI, another job) waits until the rounds end
    with side.store.session():
        run = party_steps.RoundsRun(first, stopped=False)
        while not run.stopped:  # a task run per group of rounds
            run = party_steps.party_rounds(side, run.next_round, fault, faults)
    model = party_steps.keep_model(side)
    party_steps.forget_rounds(side)
    summary = horizontal_party_summary(job_id, ref, model, options.holdout_fraction)
    publish_training_charts(flow_short(), job_id, [], summary["curves"])  # its own rows' ROC
    return {
        "job_id": job_id,
        "party": ref.party,
        **{k: model[k] for k in _MODEL_FIELDS},
        "rounds_completed": model["rounds"],
        "quality": summary["quality"],
    }
