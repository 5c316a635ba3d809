"""Flow ``sparse_lda``: one sparse linear discriminant from parties holding different rows.

party:  check table ─▶ check budget, column names ──▶ coordinator compares, agrees on order
party:  row unit: clip rows, sum class sums / counts / second moments; party unit: fit own
        rows, debias, clip; either way check the vector, add own noise share, store and
        charge the release (once)
        └─▶ secure sum of the stored vectors (tasks.secure_sum) ──▶ coordinator: noisy sum
coordinator: fit on the noisy moments (row) or average and hard-threshold (party), store
        the model ──▶ every party keeps a copy ──▶ (hold-out) each scores its held-out rows

``sparse_lda_party`` is a site's column, ``sparse_lda_coordinator`` the coordinator's;
``sparse_lda`` runs them all in this process (:mod:`flows.hospitals`).
More (the protocol, what each party learns, why): docs/protocols/sparse-lda.md.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from prefect import flow, get_run_logger

from core import test_switches
from core.job_schema import SparseLDAOptions
from core.sparse_lda import ThresholdRule
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
from storage.party_store import PartyStore
from tasks import preprocessing as pre
from tasks import secure_sum
from tasks import sparse_lda as steps
from tasks import sparse_lda_coordinator as coordinator_steps
from tasks import sparse_lda_party as party_steps
from tasks.charts import publish_training_charts
from tasks.reporting import (
    artifact_key,
    flow_short,
    markdown_table,
    publish_markdown,
    publish_model_link,
    run_namer,
)
from tasks.secure_sum import COORDINATOR, coordinator_store
from tasks.summaries import sparse_lda_summary

__all__ = [
    "SparseLDAFigures",
    "sparse_lda",
    "sparse_lda_coordinator",
    "sparse_lda_party",
    "summary_line",
]


@dataclass(frozen=True)
class SparseLDAFigures:
    """The few numbers a run is judged by (the flow's result carries them as ``figures``)."""

    method: str
    privacy_unit: str | None
    epsilon: float | None
    delta: float | None
    features_kept: int
    features: int
    holdout_rows: int
    holdout_error: float | None
    """Misclassified share of the parties' held-out rows under the released model."""

    def line(self) -> str:
        text = f"{self.features_kept} of {self.features} features kept"
        if self.holdout_error is not None:
            text += f", held-out error {self.holdout_error:.3f} on {self.holdout_rows} rows"
        return text


def _summary(job: steps.SparseLDAJob, model: dict[str, Any], figures: SparseLDAFigures) -> str:
    """The UI's view: method, privacy, who contributed, the kept features (the ledgers are
    the sites' own: each site's result, and the local run's summary)."""
    items = [
        ("method", job.method),
        ("private", "yes" if job.private else "NO (reference or test run)"),
        ("epsilon, delta per party", f"{job.epsilon:g}, {job.delta:g}" if job.private else "-"),
        ("contributors", ", ".join(model["contributors"])),
        ("rows in total", model["total_rows"]),
        ("privacy unit", model.get("privacy_unit") or "-"),
        ("noise std (per model entry)", f"{model['noise_std_of_average']:.4g}"),
        ("hard threshold", f"{model['hard_threshold']:.4g}"),
        ("features kept", f"{len(model['support'])} of {len(model['features'])}"),
        (
            "held-out error",
            "-" if figures.holdout_error is None else f"{figures.holdout_error:.3f}",
        ),
    ]
    kept = [
        {"feature": f, "weight": float(w)}
        for f, w in zip(model["features"], model["direction"], strict=True)
        if w != 0.0
    ]
    return "\n\n".join(
        [
            f"# Sparse LDA, job {job.job_id}",
            markdown_table([{"item": k, "value": v} for k, v in items]),
            "## Kept features",
            markdown_table(kept),
        ]
    )


def _job(
    job_id: str, names: list[str], options: SparseLDAOptions, preprocessing: dict[str, Any] | None
) -> tuple[steps.SparseLDAJob, ThresholdRule]:
    """The job every step agrees on and the model's hard-threshold rule; unusable options are
    refused here, before any party does anything."""
    spec = pre.pooled_spec(preprocessing, "sparse_lda").to_dict()
    threshold = agreed_threshold(options.threshold, names)
    job = steps.SparseLDAJob.of(job_id, names, options, threshold, spec)
    steps.check_job(job)
    rule = ThresholdRule(options.hard_threshold_scale, options.hard_threshold_noise_multiplier)
    return _switched(job), rule


def _switched(job: steps.SparseLDAJob) -> steps.SparseLDAJob:
    """The job, with exact vectors and nothing charged when the test switch
    ``PRIVREG_TEST_NOISELESS`` of this process names its id (tests only; each table's owner
    must allow it as well). No flow parameter or job-file key can ask for that."""
    if not test_switches.noiseless(job.job_id):
        return job
    get_run_logger().warning(
        "job %s: %s names this job: exact vectors without noise, nothing charged; the output "
        "is NOT private (a test switch)",
        job.job_id,
        test_switches.NOISELESS_VARIABLE,
    )
    job = replace(job, noise_disabled_for_testing=True)
    steps.check_job(job)
    return job


@flow(name="sparse_lda", flow_run_name=run_namer("sparse_lda"))
@keyword_options(SparseLDAOptions)
def sparse_lda(
    parties: list[dict[str, Any]],
    workspace: str | None = None,
    job_id: str | None = None,
    preprocessing: dict[str, Any] | None = None,
    *,
    options: SparseLDAOptions,
) -> dict[str, Any]:
    """Fit a sparse LDA model across parties; each party's release is (epsilon, delta)-DP,
    charged once to its own ledger.

    Runs every site's and the coordinator's side flow in this process, after checking every
    table, option, owner's permission and budget; returns the coordinator's result with each
    site's ``releases``. More: docs/protocols/sparse-lda.md.

    Args:
        parties: Descriptors of every party's table (same columns, a 0/1 label each).
        workspace: Folder for the coordinator's store and the run's messages.
        job_id: Job to continue; default derived from the tables and options.
        preprocessing: The job's preprocessing (default: standardise with the pooled mean and
            variance of one secure sum; docs/data.md says what that reveals).
    """
    refs = hospital_tables(parties)
    names = [ref.party for ref in refs]
    job, _ = _job(job_id or "pending", names, options, preprocessing)  # refuses bad options
    digests = [party_steps.check_table(ref, job) for ref in refs]  # every table, before any side
    if job_id is None:
        job_id = _derived_job_id(refs, digests, job)
    job, _ = _job(job_id, names, options, preprocessing)
    for ref in refs:  # every owner's permission and budget, before any side starts
        party_steps.check_budget(ref, job)
    agreed = (job_id, options, preprocessing)
    coordinator = functools.partial(sparse_lda_coordinator, names, *agreed)
    sites = {
        r.party: functools.partial(sparse_lda_party, r.to_dict(), names, *agreed) for r in refs
    }
    result, by_site = run_hospitals(job_id, workspace, coordinator, sites)
    # this run plays every owner: each site's release and held-out counts, one summary
    answered = {p: r for p, r in by_site.items() if isinstance(r, dict)}
    releases = {p: r["release"] for p, r in answered.items() if r["release"] is not None}
    scores = [r["holdout"] for r in answered.values() if r["holdout"] is not None]
    summary = sparse_lda_summary(job, refs, result, releases, scores, workspace)
    if not scores:  # the sites chart their own held-out rows; else the in-sample ones
        publish_training_charts("sparse-lda", job_id, [], summary["curves"])
    return {**result, "releases": releases}


def _derived_job_id(refs: list[TableRef], digests: list[str], job: steps.SparseLDAJob) -> str:
    """The tables' salted digests and every option that shapes the release: unchanged inputs
    reuse the stored releases (charged once)."""
    shaping = {k: v for k, v in job.release_parameters().items() if k != "job_id"}
    return local_job_id("sparse-lda", refs, digests, shaping)


def _figures(
    job: steps.SparseLDAJob, model: dict[str, Any], scores: list[dict[str, int]]
) -> SparseLDAFigures:
    rows = sum(s["rows"] for s in scores)
    return SparseLDAFigures(
        method=job.method,
        privacy_unit=job.privacy_unit if job.private else None,
        epsilon=job.epsilon if job.private else None,
        delta=job.delta if job.private else None,
        features_kept=len(model["support"]),
        features=len(model["features"]),
        holdout_rows=rows,
        holdout_error=sum(s["errors"] for s in scores) / rows if rows else None,
    )


def _finish(
    side: coordinator_steps.Coordinator, model: dict[str, Any], figures: SparseLDAFigures
) -> dict[str, Any]:
    """The coordinator's summary and model link; its result (no site's release: ``{}``)."""
    job = side.job
    short = job.job_id.removeprefix("sparse-lda-")
    publish_markdown(
        artifact_key("sparse-lda", short, "release"),
        _summary(job, model, figures),
        f"sparse LDA summary of job {job.job_id}",
    )
    publish_model_link(
        artifact_key("sparse-lda", short, "model"), side.store.path, steps.model_key(job.job_id)
    )
    arrays = ("direction", "mean_positive", "mean_negative")
    return {
        **{k: v for k, v in model.items() if k not in arrays},
        **{k: model[k].tolist() for k in arrays},
        "releases": {},
        "model_key": steps.model_key(job.job_id),
        "threshold": job.threshold,
        "job_id": job.job_id,
        "figures": asdict(figures),
    }


def summary_line(result: dict[str, Any]) -> str:
    """One line for the pipeline summary: method, privacy, features kept, held-out error
    (and the naive average's), ledger reuse."""
    budgets = [r["budget"] for r in result["releases"].values() if r["budget"] is not None]
    privacy = (
        f"{result['privacy_unit']}-level eps {result['epsilon']:g}"
        if result["private"]
        else "NOT private"
    )
    figures = SparseLDAFigures(**result["figures"])
    # a row-level release is fitted on pooled moments whatever ``method`` says (nothing is
    # debiased); the model records its unit only when it is private
    estimator = "pooled moments" if result.get("privacy_unit") == "row" else result["method"]
    text = f"{estimator}, {privacy}, {figures.line()}, {len(result['contributors'])} parties"
    if budgets:
        text += ", eps spent " + ", ".join(
            f"{b['epsilon_spent']:g}/{b['epsilon_total']:g}" for b in budgets
        )
    if result["releases"] and all(r["reused"] for r in result["releases"].values()):
        text += " (releases reused)"
    return text


# ---------------------------------------------------------------------------------------------
# The side flows: one per role, each run by its own organisation's process


@flow(name="sparse_lda_coordinator", flow_run_name="sparse_lda {job_id}: coordinator")
def sparse_lda_coordinator(
    parties: list[str],
    job_id: str,
    options: SparseLDAOptions,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The coordinator's side: compare columns, pooled statistics, drive the secure sum, fit,
    send the model.

    A site silent past ``stage_timeout`` is dropped while ``threshold`` remain; a re-run with
    the same ``job_id`` resumes (a stored sum or model is not redone).

    Args:
        parties: Names of the sites (as their certificates name them).
        job_id: Job name agreed with every site.
        options: The job's options (every site passes the same and checks the call's).
        preprocessing: The job's preprocessing (every site passes the same); the pooled
            statistics come from one secure sum before any release.
    """
    names = sorted(hospital_names(parties))  # every process numbers the sites alike
    job, rule = _job(job_id, names, options, preprocessing)
    endpoint = channel_for(job_id).endpoint(COORDINATOR)
    side = coordinator_steps.Coordinator(job, options, endpoint, coordinator_store())
    features = coordinator_steps.open_job(side)
    with side.store.session():  # held through the job (it exists once the job is open)
        pre.coordinator_statistics(
            job_id, features, job.spec, names, job.threshold, options.stage_timeout
        )
        if job.method == "centralized_reference":
            get_run_logger().warning("job %s: pooling every site's rows (NOT PRIVATE)", job_id)
            model = coordinator_steps.fit_pooled_reference(side)
        else:
            ctx = coordinator_steps.call_sum(side, len(features), rule)
            if secure_sum.session_sum(side.store, ctx) is None:  # else restarted: to the model
                secure_sum.unmask_sum(ctx, secure_sum.drive_session(ctx))
            model = coordinator_steps.build_model(side, ctx, rule)  # and sends it to every site
        dropped = [p for p in names if p not in model["contributors"]]
        scores = []
        if job.holdout_fraction > 0:  # the figures: the held-out rows of the sites in the model
            scores = coordinator_steps.collect_scores(side, model["contributors"])
        return {**_finish(side, model, _figures(job, model, scores)), "dropped": dropped}


@flow(name="sparse_lda_party", flow_run_name="sparse_lda {job_id}: {own[party]}")
def sparse_lda_party(
    own: dict[str, Any],
    parties: list[str],
    job_id: str,
    options: SparseLDAOptions,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One site's side: check its table and budget, announce its columns, store (and charge,
    once) its noisy release, take part in the secure sum, keep the coordinator's model.

    A re-run resumes from the site's own records, charging nothing again; a coordinator's call
    that names other options is refused.

    Args:
        own: Descriptor of this site's own table (with its 0/1 label column).
        parties: Names of every site of the job, this one included.
        job_id: Job name agreed with the coordinator and the other sites.
        options: The job's options (the coordinator's call must state the same).
        preprocessing: The job's preprocessing (the coordinator's call must ask for the same).
    """
    names = sorted(hospital_names(parties))  # every process numbers the sites alike
    ref = own_table(own, names)
    job, rule = _job(job_id, names, options, preprocessing)
    site = party_steps.Site(ref, job, channel_for(job_id).endpoint(ref.party))
    fault = test_switches.party_fault(job_id)  # tests only (PRIVREG_TEST_PARTY_FAULT)
    faults = secure_sum.Faults.of_job(job_id, names)  # tests only: a step that fails or hangs
    with PartyStore.of(ref).session():  # held through the job: no opening of it per step
        party_steps.check_table(ref, job)
        party_steps.join_job(site)  # budget check (a stored release is not charged again)
        features = party_steps.agreed_features(site.endpoint)
        pre.party_statistics(ref, job_id, features, job.spec, names, job.holdout_rows)
        release, ctx = None, None
        if job.method == "centralized_reference":
            party_steps.send_rows_not_private(site, features)
        else:
            party_steps.prefetch_sum_call(site)  # arrives while the release is computed
            release = party_steps.release_contribution(site, features)
            ctx = party_steps.await_sum_call(site, rule, len(features))
            if not party_steps.model_out(site.endpoint):  # the sum is open: take part in it
                secure_sum.contribute(
                    ref,
                    ctx,
                    lambda: secure_sum.mask_stored_input(ref, ctx, steps.input_key(job_id)),
                    lambda: party_steps.model_out(site.endpoint),
                    fault,
                    faults,
                )
        model = party_steps.keep_model(site, ctx)
        score = None
        if job.holdout_fraction > 0 and ref.party in model["contributors"]:  # for the figures
            score = party_steps.score_holdout(site)
            roc = {f"{ref.party}'s {score['rows']} held-out rows": score.pop("roc")}
            publish_training_charts(flow_short(), job_id, [], roc)  # its own chart
    arrays = ("direction", "mean_positive", "mean_negative")
    return {
        **{k: v for k, v in model.items() if k not in arrays},
        **{k: np.asarray(model[k]).tolist() for k in arrays},
        "party": ref.party,
        "release": release,
        "holdout": score,
        "model_key": steps.model_key(job_id),
    }
