"""Flow ``horizontal_lr``: logistic regression on rows spread over parties, by masked sums.

hospital:     check own table ──▶ column names ──▶ coordinator compares (once, before any round)
hospital:     job key ──▶ coordinator admits                (once per job, or a re-key)
then per round r:
coordinator:  call (active parties, their keys) ─▶ add masked ─▶ unmask sum, update, commit
hospital:                   mask update ─▶ answer unmask ─▶ check and save model
(the masking is ``core.secagg.multiround``: keys agreed once per job, masks per round,
wired by ``tasks.secure_rounds``)
Every arrow crosses the channel; the coordinator sees only the row-weighted mean update, the
mean loss and the total row count. Each stage waits up to ``stage_timeout`` seconds: a
hospital that has not answered by then, whatever the reason, has dropped out, and the round
goes on while at least ``threshold`` remain. A hospital that dropped is left out of the next
call, re-keys and asks to rejoin, and is called again from the round after. Each hospital
checks that the model it is sent is the update of the previous one by the round's mean
update, which it unmasks itself too, and never contributes twice at one model. A re-run of
the same job resumes after the coordinator's last commit (a hospital that had not saved it
catches up from its result).

The protocol is written once, as one flow per role: ``horizontal_lr_party`` is one hospital's
column of the diagram and ``horizontal_lr_coordinator`` the coordinator's, each round one task
run per side. Across organisations each runs in its own process over the network channel;
``horizontal_lr`` runs them all in this process, each side in its own thread as its own party
over the shared folder (:mod:`flows.hospitals`), with the same job id and options.

Hold-out (``holdout_fraction``): each hospital keeps that share of its own rows out of every
update (split seeded by the job id) and, at the end, scores them with the final model; only
aggregates leave it (AUC, log-loss, its class-prior baseline, the row count). Each hospital's
summary gives its own figures; ``horizontal_lr``, which plays every owner, adds one with every
hospital's and their row-weighted pooled log-loss. The coordinator learns none of them.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed, State

from core import secagg, test_switches
from core.outcomes import BELOW_BASELINE, check_loss, rising
from core.preprocessing import PreprocessingSpec
from federation.party_config import active_config
from federation.workspace import derive_job_id
from flows.hospitals import run_hospitals
from flows.jobs import read_job
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks import horizontal_lr as steps
from tasks import preprocessing as pre
from tasks.charts import publish_training_charts
from tasks.horizontal_lr import COORDINATOR, predict_proba
from tasks.loading import load_table
from tasks.reporting import (
    Progress,
    artifact_key,
    flow_short,
    publish_model_link,
    publish_table,
    run_namer,
)
from tasks.secure_sum import Faults, SimulatedCrashError
from tasks.summaries import (
    attempt_columns,
    current_attempt,
    horizontal_party_summary,
    horizontal_summary,
)

__all__ = [
    "CRASH_POINTS",
    "SimulatedCrashError",
    "horizontal_lr",
    "horizontal_lr_coordinator",
    "horizontal_lr_party",
    "predict_proba",
]

#: The stages of a round at which a hospital can drop (test switch ``PRIVREG_TEST_FAULTS``).
STAGES = ("mask_input", "reveal_shares")
#: Where ``PRIVREG_TEST_CRASH_AFTER`` stops the coordinator: after a stage, or after its
#: commit of a round but before it sent the round's model.
CRASH_POINTS = (*STAGES, "commit")


def _party_refs(parties: list[dict[str, Any]]) -> list[TableRef]:
    refs = [TableRef.from_dict(p) for p in parties]
    if len(refs) < 2:
        raise ValueError(f"horizontal_lr needs at least 2 parties, got {len(refs)}")
    names = [r.party for r in refs]
    if len(set(names)) != len(names) or COORDINATOR in names:
        raise ValueError(f"party names must be unique and not {COORDINATOR!r}; got {names}")
    if len({r.path.resolve() for r in refs}) != len(refs):
        raise ValueError("every party needs its own database file")
    for ref in refs:
        if ref.label_column is None:
            raise ValueError(f"party {ref.party!r}: the descriptor names no label_column")
    return refs


def _check_options(
    rounds: int,
    local_epochs: int,
    learning_rate: float,
    l2: float,
    tol: float,
    timeout: float,
    holdout_fraction: float = 0.0,
) -> None:
    if not 0.0 <= holdout_fraction < 0.5:
        raise ValueError(f"holdout_fraction must be in [0, 0.5), got {holdout_fraction}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"stage_timeout must be a positive number of seconds, got {timeout}")
    if rounds < 1 or local_epochs < 0:
        raise ValueError(f"need rounds >= 1 and local_epochs >= 0, got {rounds}, {local_epochs}")
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate}")
    if not (math.isfinite(l2) and l2 >= 0 and tol >= 0):
        raise ValueError(f"l2 and tol must be non-negative, got {l2}, {tol}")


def _publish(job_id: str, model: dict[str, Any], workspace: str | None) -> None:
    short = job_id.removeprefix("horizontal-lr-")
    now = current_attempt()
    rows = [
        {
            "round": e["round"],
            "loss": e["loss"],
            "seconds": e["seconds"],
            "survivors": len(e["survivors"]),
            "parties": ", ".join(e["survivors"]),
            "max weight change": e["change"],
            **attempt_columns(e.get("attempt"), now),
        }
        for e in model["history"]
    ]
    publish_table(
        artifact_key("horizontal-lr", short, "rounds"),
        rows,
        f"horizontal_lr {job_id}: securely aggregated loss per round",
    )
    publish_model_link(
        artifact_key("horizontal-lr", short, "model"),
        steps.coordinator_store(workspace).path,
        steps.model_key(job_id),
    )


@flow(name="horizontal_lr", flow_run_name=run_namer("horizontal_lr"))
def horizontal_lr(
    parties: list[dict[str, Any]],
    rounds: int = 20,
    local_epochs: int = 0,
    learning_rate: float = 0.2,
    l2: float = 1e-3,
    tol: float = 1e-6,
    seed: int = 0,
    threshold: int | None = None,
    workspace: str | None = None,
    job_id: str | None = None,
    stage_timeout: float = 60.0,
    holdout_fraction: float = 0.0,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any] | State:
    """Train logistic regression on the parties' rows; the coordinator sees only masked sums.

    ``local_epochs=0`` averages gradients (the same model as centralised full-batch GD);
    ``k > 0`` runs FedAvg with k local epochs. Training stops after ``rounds`` rounds or once
    the largest weight change falls below ``tol``. ``threshold`` (default: a strict majority)
    is how many parties must remain at every stage. ``job_id`` defaults to a digest of the
    parties' salted table digests and every option that shapes the model (not ``rounds`` or
    ``tol``), so re-running resumes and asking for more rounds continues. Training is
    deterministic (zero start, full-batch steps); ``seed`` only names the job, since masks
    must come from fresh OS randomness. ``stage_timeout`` is how long each secure-aggregation
    stage waits for the parties' answers before counting the silent ones as dropped.

    Fault injection, for tests only, comes from the job's test switches in this process's
    environment (:mod:`core.test_switches`), which every side reads: ``PRIVREG_TEST_FAULTS``
    makes a hospital's step fail or never answer (it is dropped, then rejoins),
    ``PRIVREG_TEST_CRASH_AFTER`` makes the coordinator raise :class:`SimulatedCrashError` at a
    point of a round, as if its process were killed.

    Args:
        parties: Descriptors of every party's table (same columns, a label column each).
        rounds: Most rounds to run in total; asking for more later continues the job.
        local_epochs: 0 averages gradients; k > 0 runs FedAvg with k local epochs.
        learning_rate: Step size of each round's update.
        l2: L2 penalty on the coefficients.
        tol: Stop once the largest weight change falls below this.
        seed: Names the job (training itself is deterministic).
        threshold: Parties that must remain at every stage (default: a strict majority).
        workspace: Folder for the coordinator's store and the run's messages.
        job_id: Job to continue; default derived from the tables and options.
        stage_timeout: Seconds a secure-sum stage waits before silent parties count as dropped.
        holdout_fraction: Share of each party's rows (< 0.5) kept out of training; each party
            scores its own for the summary (0: none, the figures are then in-sample).
        preprocessing: The job's preprocessing (default: standardise with pooled statistics
            from one secure sum; see tasks/preprocessing.py for what the coordinator learns).

    A round whose loss is non-finite or far above the first round's stops the run with
    ``DivergenceError``; a model no better than the class prior on held-out rows ends in the
    COMPLETED state named "Below baseline" (its result is the same dictionary).
    """
    spec = _spec(preprocessing)
    refs = _party_refs(parties)
    names = [ref.party for ref in refs]
    threshold = secagg.default_threshold(len(names)) if threshold is None else threshold
    _check_options(rounds, local_epochs, learning_rate, l2, tol, stage_timeout, holdout_fraction)
    secagg.new_session("option-check", names, threshold, 1)  # refuses an unsafe threshold
    digests = [steps.check_table(ref) for ref in refs]  # every table, before any side starts
    if job_id is None:
        shaping = {"local_epochs": local_epochs, "learning_rate": learning_rate, "l2": l2}
        shaping["preprocessing"] = spec.to_dict()
        if holdout_fraction:
            shaping["holdout_fraction"] = holdout_fraction
        job_id = _derived_job_id(refs, digests, {**shaping, "seed": seed, "threshold": threshold})
    agreed = {
        "local_epochs": local_epochs,
        "learning_rate": learning_rate,
        "l2": l2,
        "preprocessing": spec.to_dict(),
    }
    coordinator = functools.partial(
        horizontal_lr_coordinator, names, job_id, rounds, tol=tol, threshold=threshold,
        stage_timeout=stage_timeout, workspace=workspace, **agreed,
    )  # fmt: skip
    own = {  # each hospital's own hold-out; the terms every call must state
        "holdout_fraction": holdout_fraction, "threshold": threshold,
        "stage_timeout": stage_timeout, **agreed,
    }  # fmt: skip
    hospitals = {
        ref.party: functools.partial(horizontal_lr_party, ref.to_dict(), names, job_id, **own)
        for ref in refs
    }
    result, _ = run_hospitals(job_id, workspace, coordinator, hospitals)
    # this run plays every owner: one summary with each hospital's figures and the pooled ones
    summary = horizontal_summary(
        job_id, refs, result, result["rounds_run"], workspace, holdout_fraction
    )
    return _ended({**result, "model_key": steps.model_key(job_id), "outcome": summary["outcome"]})


def _derived_job_id(refs: list[TableRef], digests: list[str], shaping: dict[str, Any]) -> str:
    """The tables' salted digests and every option that shapes the model (not ``rounds`` or
    ``tol``): re-running resumes, and asking for more rounds continues."""
    described = [
        {**ref.to_dict(), "database": None, "digest": digest}
        for ref, digest in zip(refs, digests, strict=True)
    ]
    return derive_job_id("horizontal-lr", {"parties": described, **shaping})


def _ended(result: dict[str, Any]) -> dict[str, Any] | State:
    """The result, or the COMPLETED state named "Below baseline" carrying it."""
    if not str(result.get("outcome", "")).startswith(BELOW_BASELINE):
        return result
    get_run_logger().warning("horizontal_lr %s: %s", result["job_id"], result["outcome"])
    return Completed(name=BELOW_BASELINE, message=result["outcome"], data=result)


def _spec(preprocessing: dict[str, Any] | None) -> PreprocessingSpec:
    return pre.pooled_spec(preprocessing, "horizontal_lr", indicators=True)


class _LossWatch:
    """The coordinator's view of the securely aggregated loss: it stops a diverging run
    (DivergenceError naming the round) and warns while the loss keeps rising."""

    def __init__(self, job_id: str, workspace: str | None, start: int) -> None:
        self.job_id, self.losses, self.warned = job_id, [], False
        if start > 0:  # resumed: the first round's loss is in the coordinator's checkpoint
            saved = steps.checkpoints(steps.coordinator_store(workspace), job_id).load(start - 1)
            self.losses = [float(e["loss"]) for e in saved["history"]]

    def check(self, round_: int, loss: float) -> None:
        first = self.losses[0] if self.losses else None
        check_loss("horizontal_lr", self.job_id, round_, loss, first)
        self.losses.append(loss)
        if rising(self.losses) and not self.warned:
            self.warned = True
            get_run_logger().warning(
                "horizontal_lr %s: the aggregated loss rose in each of the last 3 rounds "
                "(%s); the learning rate may be too large for these features",
                self.job_id,
                ", ".join(f"{v:.4g}" for v in self.losses[-4:]),
            )


# ---------------------------------------------------------------------------------------------
# Party mode: one flow per role, each run by its own organisation's process


def _own_folder(workspace: str | None) -> str | None:
    """The coordinator's store lives in its own folder (its party configuration's root)."""
    config = active_config()
    return workspace if workspace is not None or config is None else str(config.root)


def _party_names(parties: list[str]) -> list[str]:
    names = list(parties)
    if len(names) < 2 or len(set(names)) != len(names) or COORDINATOR in names:
        raise ValueError(
            f"need at least 2 distinct party names, none of them {COORDINATOR!r}; got {names}"
        )
    return names


@flow(name="horizontal_lr_coordinator", flow_run_name="horizontal_lr {job_id}: coordinator")
def horizontal_lr_coordinator(
    parties: list[str],
    job_id: str,
    rounds: int = 20,
    local_epochs: int = 0,
    learning_rate: float = 0.2,
    l2: float = 1e-3,
    tol: float = 1e-6,
    threshold: int | None = None,
    stage_timeout: float = 60.0,
    join_timeout: float = 600.0,
    workspace: str | None = None,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The coordinator's side: call each round, run its secure-sum stages, update the model.

    A party that does not answer a stage by its deadline (``stage_timeout`` after the stage
    opens), whatever the reason, is dropped from that round; the round goes on while at least
    ``threshold`` remain and fails naming the missing parties otherwise. A re-run with the
    same ``job_id`` resumes after the last round it committed (re-sending that round's
    result); the parties resume from their own checkpoints.

    Args:
        parties: Names of the hospitals (as their certificates name them).
        job_id: Job name agreed with every party.
        rounds: Most rounds to run.
        local_epochs: 0 averages gradients; k > 0 runs FedAvg with k local epochs.
        learning_rate: Step size of each round's update (every party checks it).
        l2: L2 penalty on the coefficients.
        tol: Stop once the largest weight change falls below this.
        threshold: Parties that must remain at every stage (default: a strict majority).
        stage_timeout: Seconds each stage waits before silent parties count as dropped.
        join_timeout: Seconds to wait for the parties to announce their columns (start-up).
        workspace: Folder of the coordinator's store (default: its party folder).
        preprocessing: The job's preprocessing (every hospital passes the same); pooled
            statistics come from secure sums before the first round.
    """
    spec = _spec(preprocessing)
    names = _party_names(parties)
    threshold = secagg.default_threshold(len(names)) if threshold is None else threshold
    _check_options(rounds, local_epochs, learning_rate, l2, tol, stage_timeout)
    secagg.new_session("option-check", names, threshold, 1)  # refuses an unsafe threshold
    workspace = _own_folder(workspace)
    options = steps.TrainingOptions(local_epochs, learning_rate, l2, tol)
    opened = steps.open_job(names, job_id, workspace, threshold, join_timeout)
    start = opened["last_round"] + 1
    pre.coordinator_statistics(
        job_id, opened["features"], spec, names, threshold, workspace, stage_timeout
    )
    n_features = steps.coordinator_width(job_id, opened["features"], workspace)

    def round_ctx(round_: int) -> steps.RoundContext:
        return steps.round_context(
            job_id, round_, names, threshold, n_features, workspace, stage_timeout
        )

    converged = opened["change"] is not None and opened["change"] < tol
    progress = Progress(rounds, f"horizontal_lr {job_id}: rounds finished")
    progress.update(rounds if converged else start)
    if start > 0:  # re-send the committed round's result: a party may not have it yet
        get_run_logger().info("job %s: resuming after round %d", job_id, start - 1)
        steps.resend_model(round_ctx(start - 1), options)
    if start < rounds and not converged:  # the parties' keys, once per job
        steps.refuse_if_stopped(job_id, start, names, workspace)
        steps.admit_keys(round_ctx(start).job, start, opened["announced"], stage_timeout)
    ran = 0
    watch = _LossWatch(job_id, workspace, start)
    faults = Faults.of_job(job_id, names, STAGES)  # tests only; empty in production
    left_out: list[list[str]] = []  # per round run, who was not waited for
    with steps.store_held(steps.coordinator_store(workspace)):  # no opening per step
        for round_ in range(start, rounds):
            if converged:
                break
            # one task run per round: call, masked inputs, unmasking, model
            done = steps.coordinator_round(round_ctx(round_), options, faults)
            left_out.append(done["left_out"])
            entry = done["entry"]
            watch.check(round_, entry["loss"])
            ran, converged = ran + 1, entry["change"] < tol
            progress.update(rounds if converged else round_ + 1)
    model = steps.coordinator_model(job_id, workspace)
    steps.stop_parties(round_ctx(model["rounds"]), options)
    _publish(job_id, model, workspace)
    # the securely aggregated loss only: the coordinator holds no labels, so no ROC here
    publish_training_charts(flow_short(), job_id, [e["loss"] for e in model["history"]])
    return {
        "job_id": job_id,
        "features": model["features"],
        "coefficients": model["coefficients"],
        "intercept": model["intercept"],
        "weights": model["weights"],
        "history": model["history"],
        "dropped": [[p for p in names if p not in e["survivors"]] for e in model["history"]],
        "left_out": left_out,
        "preprocessing": model.get("preprocessing"),
        "rounds_completed": model["rounds"],
        "rounds_run": ran,
        "resumed_from": start,
        "converged": converged,
        "threshold": threshold,
    }


@flow(name="horizontal_lr_party", flow_run_name="horizontal_lr {job_id}: {own[party]}")
def horizontal_lr_party(
    own: dict[str, Any],
    parties: list[str],
    job_id: str,
    local_epochs: int = 0,
    learning_rate: float = 0.2,
    l2: float = 1e-3,
    holdout_fraction: float = 0.0,
    preprocessing: dict[str, Any] | None = None,
    threshold: int | None = None,
    stage_timeout: float = 60.0,
) -> dict[str, Any]:
    """One hospital's side: join, then per round contribute its masked update and check and
    save the coordinator's model, until the coordinator's stop.

    A re-run (e.g. after the process was killed) resumes after this party's last saved
    round: rounds it missed are caught up from the coordinator's results (each one checked
    against the previous model), and a round it already contributed to is re-sent from its
    own records, never masked twice. (Tests kill or fail this process before a stage with
    the test switch ``PRIVREG_TEST_PARTY_FAULT``; see :mod:`core.test_switches`.)

    Args:
        own: Descriptor of this hospital's own table (with its label column).
        parties: Names of every hospital of the job, this one included.
        job_id: Job name agreed with the coordinator and the other hospitals.
        local_epochs: 0 averages gradients; k > 0 runs FedAvg (must match the coordinator).
        learning_rate: Step size agreed for the job (a different one is refused).
        l2: L2 penalty agreed for the job.
        holdout_fraction: Share of this hospital's rows (< 0.5) kept out of training and
            scored for its summary (its own choice; 0: none, the figures are then in-sample).
        preprocessing: The job's preprocessing (the coordinator's call must ask for the same).
        threshold: Hospitals needed at every stage, as agreed (default: a strict majority); a
            coordinator's call that states another is refused, naming it.
        stage_timeout: The agreed seconds a stage waits; a call stating others is refused.
    """
    spec = _spec(preprocessing)
    if not 0.0 <= holdout_fraction < 0.5:
        raise ValueError(f"holdout_fraction must be in [0, 0.5), got {holdout_fraction}")
    ref = TableRef.from_dict(own)
    names = _party_names(parties)
    if ref.party not in names or ref.label_column is None:
        raise ValueError(
            f"party {ref.party!r}: its table must name a label_column and the party must be "
            f"one of {names}"
        )
    options = steps.TrainingOptions(local_epochs, learning_rate, l2, 0.0, holdout_fraction)
    fault = test_switches.party_fault(job_id)  # tests only; None in production
    faults = Faults.of_job(job_id, names, STAGES)  # tests only: a step that fails or hangs
    steps.check_table(ref)
    round_ = steps.join_job(ref, job_id)["last_round"] + 1
    features = steps.agreed_features(ref, job_id)
    pre.party_statistics(ref, job_id, features, spec, names, holdout_fraction)
    # keys once per job (kept across a restart); then a task run per group of rounds
    agreed = threshold or secagg.default_threshold(len(names))  # each call must state it
    width = steps.model_width(ref.database, job_id, features)  # missing indicators too
    first = steps.round_context(job_id, round_, names, agreed, width, stage_timeout=stage_timeout)
    steps.join_rounds(ref, first)  # with this party's own terms: parties, threshold, timeout
    with steps.store_held(PartyStore.of(ref)):  # no opening of its database per step
        run = steps.RoundsRun(round_, stopped=False)
        while not run.stopped:
            run = steps.party_rounds(
                ref, job_id, run.next_round, names, width, options, fault, faults
            )
    model = steps.keep_model(ref, job_id, holdout_fraction)
    steps.forget_rounds(ref, job_id, names)
    summary = horizontal_party_summary(job_id, ref, model, holdout_fraction)
    publish_training_charts(flow_short(), job_id, [], summary["curves"])  # its own rows' ROC
    return {
        "job_id": job_id,
        "party": ref.party,
        "features": model["features"],
        "coefficients": model["coefficients"],
        "intercept": model["intercept"],
        "weights": model["weights"],
        "rounds_completed": model["rounds"],
        "quality": summary["quality"],
    }


def horizontal_job(
    job_file: str = "jobs/horizontal_demo.json", workspace: str | None = None
) -> dict[str, Any]:
    """Import each party's source file into its store, then train (the demo entry point)."""
    job = read_job(job_file)
    descriptors = []
    spec = PreprocessingSpec.from_dict(job.get("preprocessing"))
    for party in job["parties"].values():
        ref = TableRef.from_dict(party["table"])
        own = spec.with_party(party.get("preprocessing"))  # its missing values, categories
        load_table(party["source"], ref, preprocessing=own.to_dict())
        descriptors.append(ref.to_dict())
    options = job.get("horizontal_lr", {})
    result = horizontal_lr(
        descriptors, workspace=workspace, preprocessing=spec.to_dict(), **options
    )
    last = result["history"][-1]
    print(
        f"job {result['job_id']}: {result['rounds_completed']} rounds "
        f"({result['rounds_run']} run now), loss {last['loss']:.4f}"
    )
    return result


if __name__ == "__main__":
    horizontal_job(*sys.argv[1:2])
