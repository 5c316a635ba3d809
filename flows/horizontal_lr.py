"""Flow ``horizontal_lr``: logistic regression on rows spread over parties, by masked sums.

check own table ──▶ column names ──▶ coordinator compares        (once, before any round)
then per round r (every task's run name starts with "round r:"):
party:        advertise keys ─▶ share keys ─▶ mask update ─▶ reveal shares ─▶ save model
coordinator:    publish keys ─▶ route shares ─▶ add masked ─▶ unmask sum, update, checkpoint
(the key, share, routing and reveal steps are the shared tasks of ``tasks.secure_sum``)
Every arrow crosses the channel; the coordinator sees only the row-weighted mean update, the
mean loss and the total row count. Each stage runs every party's step at once and waits up to
``stage_timeout`` seconds (``tasks.secure_sum.run_session``): a party that has not answered by
then, whatever the reason, has dropped out, and the round goes on while at least ``threshold``
remain. Each party checks that the model it is sent is the update of the previous one by the
round's mean update, which it unmasks itself too, and never contributes twice at one model.
A re-run of the same job resumes after the last round that every party finished.

Hold-out (``holdout_fraction``): each party keeps that share of its own rows out of every
update (split seeded by the job id) and, at the end, scores them with the final model; only
aggregates leave it (AUC, log-loss, its class-prior baseline, the row count). The one-process
summary gives each party's figures and their row-weighted pooled log-loss; in party mode each
hospital's summary gives its own, and the coordinator learns none of them.

Party mode (each hospital and the coordinator its own process, over the network channel):
``horizontal_lr_party`` is one hospital's column of the diagram and
``horizontal_lr_coordinator`` the coordinator's; they run the same steps, with the same job
id agreed beforehand, and meet only through messages. The coordinator calls each round (a
fresh session id, the parties, threshold and options) and ends with a stop. A hospital that
missed a stage is out of the session: the following calls list it as left out and no stage
waits for it, until it asks to rejoin (it does on the first call that leaves it out, so a live
one is back a round or two later and one that is gone costs ``stage_timeout`` once). A
hospital left out, or restarted, still checks and saves every round's model from the
coordinator's result. (In the one-process flow every party is asked again each round.)
"""

from __future__ import annotations

import math
import secrets
import sys
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed, State

from core import secagg
from core.outcomes import BELOW_BASELINE, check_loss, rising
from core.preprocessing import PreprocessingSpec
from flows.jobs import read_job
from storage.descriptor import TableRef
from storage.party_config import active_config
from storage.workspace import derive_job_id
from tasks import horizontal_lr as steps
from tasks import preprocessing as pre
from tasks import secure_sum
from tasks.horizontal_lr import COORDINATOR, predict_proba
from tasks.loading import load_table
from tasks.reporting import Progress, artifact_key, publish_model_link, publish_table, run_namer
from tasks.secure_sum import Faults, SimulatedCrashError
from tasks.summaries import horizontal_party_summary, horizontal_summary

__all__ = [
    "CRASH_POINTS",
    "SimulatedCrashError",
    "horizontal_lr",
    "horizontal_lr_coordinator",
    "horizontal_lr_party",
    "predict_proba",
]

#: Where ``inject_crash_after`` can stop a run: after a secagg stage, or after the
#: coordinator's commit but before the parties saved the round.
CRASH_POINTS = (*secagg.DROPOUT_STAGES, "commit")


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


def _resume(
    refs: list[TableRef], status: dict[str, dict[str, Any]], job_id: str, workspace: str | None
) -> tuple[int, float | None]:
    """First round to run (after the last one *every* party finished) and its weight change.

    Parties (or the coordinator) that finished a later round roll back to that one.
    """
    databases = {ref.party: ref.database for ref in refs}
    databases[COORDINATOR] = str(steps.coordinator_store(workspace).path)
    last = min(s["last_round"] for s in status.values())
    for who, state in status.items():
        if state["last_round"] > last:
            status[who] = steps.rollback(who, databases[who], job_id, last)
    return last + 1, status[COORDINATOR]["change"]


def _run_round(
    refs: dict[str, TableRef],
    ctx: steps.RoundContext,
    options: steps.TrainingOptions,
    faults: Faults,
    last_round: int,
) -> dict[str, Any]:
    """One secure-aggregation session; the parties that answered in time are the survivors."""
    started = time.time()
    responders = secure_sum.run_session(refs, ctx, steps.mask_update, (options,), faults=faults)
    entry = steps.update_model(ctx, options, started, responders)
    faults.crash_point(ctx.round, "commit")
    final = ctx.round == last_round or entry["change"] < options.tol
    # every party, dropped ones too, verifies and saves the model; one failing here lags behind
    secure_sum.run_stage("save_model", steps.finish_round, refs, list(refs), ctx, options, final)
    return entry


def _publish(job_id: str, model: dict[str, Any], workspace: str | None) -> None:
    short = job_id.removeprefix("horizontal-lr-")
    rows = [
        {
            "round": e["round"],
            "loss": e["loss"],
            "seconds": e["seconds"],
            "survivors": len(e["survivors"]),
            "parties": ", ".join(e["survivors"]),
            "max weight change": e["change"],
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
    inject_faults: dict[str, dict[str, str]] | None = None,
    inject_crash_after: str | None = None,
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

    Fault injection, for tests only: ``inject_faults`` maps ``"<round or *>:<stage>"`` to
    ``{party: "raise" | "hang"}`` (that party's step fails, or never answers);
    ``inject_crash_after`` (``"<round>:<point>"``) raises :class:`SimulatedCrashError` there,
    as if the flow's process were killed.

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
        inject_faults: Party steps that fail or hang, by "<round or *>:<stage>" (tests only).
        inject_crash_after: "<round>:<point>" where the run dies (tests only).
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
    faults = Faults.parse(inject_faults, inject_crash_after, names)

    digests = [steps.check_table(ref) for ref in refs]
    if job_id is None:
        described = [
            {**ref.to_dict(), "database": None, "digest": digest}
            for ref, digest in zip(refs, digests, strict=True)
        ]
        shaping = {"local_epochs": local_epochs, "learning_rate": learning_rate, "l2": l2}
        shaping["preprocessing"] = spec.to_dict()
        if holdout_fraction:
            shaping["holdout_fraction"] = holdout_fraction
        job_id = derive_job_id(
            "horizontal-lr",
            {"parties": described, **shaping, "seed": seed, "threshold": threshold},
        )
    status = {ref.party: steps.join_job(ref, job_id, workspace) for ref in refs}
    status[COORDINATOR] = steps.open_job(names, job_id, workspace)
    n_features = len(status[COORDINATOR]["features"])
    by_name = dict(zip(names, refs, strict=True))
    pre.pooled_statistics(  # before any round: every party trains on the same scaled columns
        by_name,
        job_id,
        status[COORDINATOR]["features"],
        spec,
        threshold,
        workspace,
        stage_timeout,
        holdout_fraction,
    )
    start, change = _resume(refs, status, job_id, workspace)
    converged = change is not None and change < tol
    if start > 0:
        get_run_logger().info("job %s: resuming after round %d", job_id, start - 1)
    progress = Progress(rounds, f"horizontal_lr {job_id}: rounds finished")
    progress.update(rounds if converged else start)
    options = steps.TrainingOptions(local_epochs, learning_rate, l2, tol, holdout_fraction)
    ran = 0
    watch = _LossWatch(job_id, workspace, start)
    for round_ in range(start, rounds):
        if converged:
            break
        session = f"{job_id}/round-{round_}/{secrets.token_hex(8)}"
        ctx = steps.round_context(
            job_id, round_, session, tuple(names), threshold, n_features, workspace, stage_timeout
        )
        entry = _run_round(by_name, ctx, options, faults, rounds - 1)
        watch.check(round_, entry["loss"])
        ran += 1
        converged = entry["change"] < tol
        progress.update(rounds if converged else round_ + 1)

    model = steps.coordinator_model(job_id, workspace)  # parties saved theirs in the last round
    _publish(job_id, model, workspace)
    summary = horizontal_summary(job_id, refs, model, ran, workspace, holdout_fraction)
    result = {
        "job_id": job_id,
        "features": model["features"],
        "coefficients": model["coefficients"],
        "intercept": model["intercept"],
        "weights": model["weights"],
        "history": model["history"],
        "rounds_completed": model["rounds"],
        "rounds_run": ran,
        "resumed_from": start,
        "converged": converged,
        "threshold": threshold,
        "model_key": steps.model_key(job_id),
        "outcome": summary["outcome"],
        "preprocessing": model.get("preprocessing"),  # the pooled statistics, as scoring uses
    }
    return _ended(result)


def _ended(result: dict[str, Any]) -> dict[str, Any] | State:
    """The result, or the COMPLETED state named "Below baseline" carrying it."""
    if not str(result.get("outcome", "")).startswith(BELOW_BASELINE):
        return result
    get_run_logger().warning("horizontal_lr %s: %s", result["job_id"], result["outcome"])
    return Completed(name=BELOW_BASELINE, message=result["outcome"], data=result)


def _spec(preprocessing: dict[str, Any] | None) -> PreprocessingSpec:
    spec = PreprocessingSpec.from_dict(preprocessing)
    if spec.missing_indicator:  # the agreed column list would differ by party
        raise ValueError(
            "horizontal_lr: preprocessing.missing_indicator is not supported for rows split "
            "across parties; impute without it"
        )
    return spec


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
    n_features, start = len(opened["features"]), opened["last_round"] + 1
    pre.coordinator_statistics(
        job_id, opened["features"], spec, names, threshold, workspace, stage_timeout
    )

    def round_ctx(round_: int, session: str) -> steps.RoundContext:
        return steps.round_context(
            job_id, round_, session, tuple(names), threshold, n_features, workspace, stage_timeout
        )

    def call(round_: int, stop: bool = False, out: list[str] | None = None) -> str | None:
        return steps.call_round(
            job_id, round_, names, threshold, options, stage_timeout, stop, workspace, out
        )

    converged = opened["change"] is not None and opened["change"] < tol
    progress = Progress(rounds, f"horizontal_lr {job_id}: rounds finished")
    progress.update(rounds if converged else start)
    if start > 0:  # re-send the committed round's result: a party may not have it yet
        get_run_logger().info("job %s: resuming after round %d", job_id, start - 1)
        steps.update_model(round_ctx(start - 1, call(start - 1) or ""), options, time.time())
    ran = 0
    watch = _LossWatch(job_id, workspace, start)
    # dropped stays dropped: party -> why it is out, until it asks to rejoin
    out = {p: "never announced its columns" for p in names if p not in opened["announced"]}
    left_out: list[list[str]] = []  # per round run, who was not waited for
    for round_ in range(start, rounds):
        out = _still_out(job_id, round_, out, workspace)
        if converged or (session := call(round_, out=sorted(out))) is None:  # None: stopped
            break
        ctx, started = round_ctx(round_, session), time.time()
        live = [p for p in names if p not in out]
        absent = {p: f"{why}; left out until it asks to rejoin" for p, why in out.items()}
        # the live parties run their steps themselves; no stage waits for those left out
        responders = secure_sum.drive_session(ctx, live, absent=absent)
        left_out.append(sorted(out, key=names.index))
        entry = steps.update_model(ctx, options, started, responders)
        out.update(_newly_out(job_id, round_, live, responders))
        watch.check(round_, entry["loss"])
        ran, converged = ran + 1, entry["change"] < tol
        progress.update(rounds if converged else round_ + 1)
    model = steps.coordinator_model(job_id, workspace)
    call(model["rounds"], stop=True)
    _publish(job_id, model, workspace)
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


def _still_out(
    job_id: str, round_: int, out: dict[str, str], workspace: str | None
) -> dict[str, str]:
    """Those left out that did not ask to rejoin on the previous round's call."""
    back = steps.rejoin_requests(job_id, round_ - 1, sorted(out), workspace)
    if back:
        get_run_logger().info(
            "job %s: %s asked to rejoin; called again from round %d", job_id, back, round_
        )
    return {p: why for p, why in out.items() if p not in back}


def _newly_out(job_id: str, round_: int, live: list[str], responders: list[str]) -> dict[str, str]:
    """The live parties that missed a stage of ``round_``: out until they ask to rejoin."""
    missed = [p for p in live if p not in responders]
    if missed:
        get_run_logger().info(
            "job %s: %s missed a stage of round %d; later rounds do not wait for them until "
            "they ask to rejoin",
            job_id,
            missed,
            round_,
        )
    return {p: f"dropped in round {round_}" for p in missed}


@flow(name="horizontal_lr_party", flow_run_name="horizontal_lr {job_id}: {own[party]}")
def horizontal_lr_party(
    own: dict[str, Any],
    parties: list[str],
    job_id: str,
    local_epochs: int = 0,
    learning_rate: float = 0.2,
    l2: float = 1e-3,
    inject_fault: str | None = None,
    holdout_fraction: float = 0.0,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One hospital's side: join, then per round contribute its masked update and check and
    save the coordinator's model, until the coordinator's stop.

    A re-run (e.g. after the process was killed) resumes after this party's last saved
    round: rounds it missed are caught up from the coordinator's results (each one checked
    against the previous model), and a round it already contributed to is re-sent from its
    own records, never masked twice.

    Args:
        own: Descriptor of this hospital's own table (with its label column).
        parties: Names of every hospital of the job, this one included.
        job_id: Job name agreed with the coordinator and the other hospitals.
        local_epochs: 0 averages gradients; k > 0 runs FedAvg (must match the coordinator).
        learning_rate: Step size agreed for the job (a different one is refused).
        l2: L2 penalty agreed for the job.
        inject_fault: "<round>:<stage>:kill|raise" (tests only).
        holdout_fraction: Share of this hospital's rows (< 0.5) kept out of training and
            scored for its summary (its own choice; 0: none, the figures are then in-sample).
        preprocessing: The job's preprocessing (the coordinator's call must ask for the same).
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
    steps.check_table(ref)
    round_ = steps.join_job(ref, job_id)["last_round"] + 1
    features = steps.agreed_features(ref, job_id)
    pre.party_statistics(ref, job_id, features, spec, names, holdout_fraction)
    while (ctx := steps.await_round(ref, job_id, round_, names, options)) is not None:
        if steps.left_out(ref, ctx):  # dropped earlier: ask back, only take this model
            steps.ask_to_rejoin(ref, ctx)
        elif steps.round_open(ref, ctx):  # contribute to it
            secure_sum.contribute(
                ref,
                ctx,
                lambda: steps.mask_update(ref, ctx, options),
                lambda: not steps.round_open(ref, ctx),
                inject_fault,
            )
        steps.finish_round(ref, ctx, options)
        round_ += 1
    model = steps.keep_model(ref, job_id)
    summary = horizontal_party_summary(job_id, ref, model, holdout_fraction)
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
