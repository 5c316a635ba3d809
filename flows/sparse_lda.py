"""Flow ``sparse_lda``: one sparse linear discriminant from parties holding different rows.

party:  check table ─▶ check budget, column names ──▶ coordinator compares, agrees on order
party:  fit own rows, debias, clip, add own noise share; store and charge the release (once)
        └─▶ secure sum of the stored vectors (tasks.secure_sum) ──▶ coordinator: noisy sum
coordinator: average, hard-threshold, store the model ──▶ every party keeps a copy

What crosses the channel: column names, the agreed order, secure-aggregation messages (public
keys, encrypted shares, masked vectors, unmask shares) and the final model. No party's vector
and no noiseless sum ever crosses or reaches the flow. ``method="naive"`` averages the
un-debiased fits the same way; ``method="centralized_reference"`` sends every party's rows to
the coordinator in the clear (a reference, NOT private, never charged).

``sparse_lda_job`` runs a job file end to end: load each party's table, set each party's
budget from the job file, then run the flow (``python -m flows.sparse_lda <job file>``).
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger

from core import secagg
from core.sparse_lda import ThresholdRule
from core.sparse_lda.aggregation import DEFAULT_THRESHOLD_SCALE
from core.sparse_lda.dantzig import DEFAULT_DIRECTION_RADIUS_SCALE
from flows.jobs import read_job
from storage.descriptor import TableRef
from storage.workspace import derive_job_id
from tasks import secure_sum
from tasks import sparse_lda as steps
from tasks.loading import load_table
from tasks.reporting import (
    artifact_key,
    markdown_table,
    publish_markdown,
    publish_model_link,
    run_namer,
)
from tasks.secure_sum import COORDINATOR
from tasks.summaries import sparse_lda_summary

__all__ = ["sparse_lda", "sparse_lda_job", "summary_line"]


def _party_refs(parties: list[dict[str, Any]]) -> list[TableRef]:
    refs = [TableRef.from_dict(p) for p in parties]
    if len(refs) < 2:
        raise steps.SparseLDASetupError(f"sparse_lda needs at least 2 parties, got {len(refs)}")
    names = [r.party for r in refs]
    if len(set(names)) != len(names) or COORDINATOR in names:
        raise steps.SparseLDASetupError(
            f"party names must be unique and not {COORDINATOR!r}; got {names}"
        )
    if len({r.path.resolve() for r in refs}) != len(refs):
        raise steps.SparseLDASetupError("every party needs its own database file")
    for ref in refs:
        if ref.label_column is None:
            raise steps.SparseLDASetupError(f"party {ref.party!r}: the descriptor names no label")
    return refs


def _dropouts(inject: dict[str, list[str]] | None, names: list[str]) -> secure_sum.Present:
    """Test-only: ``{stage: [parties]}`` fall silent at that secure-sum stage."""
    for stage, silent in (inject or {}).items():
        if stage not in secagg.DROPOUT_STAGES:
            raise ValueError(f"inject_dropouts stage {stage!r} must be in {secagg.DROPOUT_STAGES}")
        unknown = sorted(set(silent) - set(names))
        if unknown:
            raise ValueError(f"inject_dropouts[{stage!r}] names unknown parties {unknown}")

    def present(stage: str, parties: list[str]) -> list[str]:
        return [p for p in parties if p not in (inject or {}).get(stage, [])]

    return present


def _summary(job: steps.SparseLDAJob, model: dict[str, Any], releases: dict[str, Any]) -> str:
    """The UI's view: method, privacy, who contributed, the kept features, each ledger."""
    items = [
        ("method", job.method),
        ("private", "yes" if job.private else "NO (reference or test run)"),
        ("epsilon, delta per party", f"{job.epsilon:g}, {job.delta:g}" if job.private else "-"),
        ("contributors", ", ".join(model["contributors"])),
        ("rows in total", model["total_rows"]),
        ("noise std of the average", f"{model['noise_std_of_average']:.4g}"),
        ("hard threshold", f"{model['hard_threshold']:.4g}"),
        ("features kept", f"{len(model['support'])} of {len(model['features'])}"),
    ]
    ledger = [
        {
            "party": party,
            "release": "reused, not charged again" if r["reused"] else "new, charged once",
            "epsilon spent / total": f"{r['budget']['epsilon_spent']:g} / "
            f"{r['budget']['epsilon_total']:g}",
        }
        for party, r in releases.items()
        if r["budget"] is not None
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
            "## Privacy ledgers",
            markdown_table(ledger),
            "## Kept features",
            markdown_table(kept),
        ]
    )


@flow(name="sparse_lda", flow_run_name=run_namer("sparse_lda"))
def sparse_lda(
    parties: list[dict[str, Any]],
    epsilon: float,
    delta: float,
    direction_clip_norm: float,
    mean_clip_norm: float,
    method: str = "debiased",
    lambda_scale: float = DEFAULT_DIRECTION_RADIUS_SCALE,
    precision_method: str = "nodewise_lasso",
    hard_threshold_scale: float = DEFAULT_THRESHOLD_SCALE,
    hard_threshold_noise_multiplier: float | None = None,
    colluding_parties: int = 0,
    threshold: int | None = None,
    workspace: str | None = None,
    job_id: str | None = None,
    noise_disabled_for_testing: bool = False,
    inject_dropouts: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Fit a sparse LDA model across parties; each party's release is (epsilon, delta)-DP.

    ``epsilon``/``delta`` are charged once to every party's ledger (its table is protected;
    the guarantee is party-level, so row-level too). ``direction_clip_norm`` and
    ``mean_clip_norm`` bound what one party can move (choose them without looking at the
    data). ``lambda_scale`` sets the Dantzig radius ``lambda_scale * sqrt(log d / n)``;
    ``hard_threshold_scale`` and ``hard_threshold_noise_multiplier`` the threshold
    ``max(scale sqrt(log d / N), multiplier * noise sd)`` (``None``: ``sqrt(2 log d)``).
    ``threshold`` (default: a strict majority) is the fewest parties whose vectors the
    coordinator may unmask; noise shares are sized so that any such sum minus
    ``colluding_parties`` colluders' shares still carries the calibrated sigma.

    Test only: ``noise_disabled_for_testing`` sends exact, unclipped vectors without noise and
    charges nothing (NOT private); ``inject_dropouts`` maps a secure-sum stage to parties that
    fall silent there.

    Args:
        parties: Descriptors of every party's table (same columns, a 0/1 label each).
        epsilon: Epsilon charged once to every party's ledger.
        delta: Delta charged once to every party's ledger.
        direction_clip_norm: Bound on one party's direction vector (set without the data).
        mean_clip_norm: Bound on one party's class means (set without the data).
        method: "debiased", "naive", or "centralized_reference" (NOT private).
        lambda_scale: Scale of the Dantzig radius lambda_scale * sqrt(log d / n).
        precision_method: How each party estimates its precision matrix.
        hard_threshold_scale: Scale of the final hard threshold.
        hard_threshold_noise_multiplier: Noise multiple in the threshold (None: sqrt(2 log d)).
        colluding_parties: Colluders whose noise shares the calibration discounts.
        threshold: Fewest parties whose vectors may be unmasked (default: strict majority).
        workspace: Folder for the coordinator's store and the run's messages.
        job_id: Job to continue; default derived from the tables and options.
        noise_disabled_for_testing: Exact vectors, no noise, nothing charged (tests only).
        inject_dropouts: Parties that fall silent, by secure-sum stage (tests only).
    """
    refs = _party_refs(parties)
    names = [ref.party for ref in refs]
    threshold = secagg.default_threshold(len(names)) if threshold is None else threshold
    secagg.new_session("option-check", names, threshold, 1)  # refuses an unsafe threshold
    job = steps.SparseLDAJob(
        job_id or "pending",
        workspace,
        tuple(names),
        method,
        epsilon,
        delta,
        direction_clip_norm,
        mean_clip_norm,
        threshold,
        colluding_parties,
        lambda_scale,
        precision_method,
        noise_disabled_for_testing,
    )
    steps.check_job(job)
    rule = ThresholdRule(hard_threshold_scale, hard_threshold_noise_multiplier)
    present = _dropouts(inject_dropouts, names)

    digests = [steps.check_table(ref) for ref in refs]
    if job_id is None:
        described = [
            {**ref.to_dict(), "database": None, "digest": digest}
            for ref, digest in zip(refs, digests, strict=True)
        ]
        shaping = {k: v for k, v in job.release_parameters().items() if k != "job_id"}
        job_id = derive_job_id("sparse-lda", {"parties": described, **shaping})
        job = replace(job, job_id=job_id)
    for ref in refs:
        steps.join_job(ref, job)
    features = steps.open_job(job)
    by_name = dict(zip(names, refs, strict=True))

    releases: dict[str, Any] = {}
    ctx = None
    if method == "centralized_reference":
        get_run_logger().warning("job %s: pooling every party's rows (NOT PRIVATE)", job_id)
        for ref in refs:
            steps.send_rows_not_private(ref, job)
        model = steps.fit_pooled_reference(job)
    else:
        releases = secure_sum.each_party(steps.release_contribution, by_name, names, job)
        ctx = steps.sum_context(job, len(features), f"{job_id}/{secrets.token_hex(8)}")
        secure_sum.sum_stored_vectors(
            by_name, ctx, steps.input_key(job_id), list(releases), present
        )
        model = steps.build_model(job, ctx, rule)
    secure_sum.each_party(steps.keep_model, by_name, names, job, ctx)  # dropped ones too
    sparse_lda_summary(job, refs, model, releases)
    return _finish(job, model, releases)


def _finish(
    job: steps.SparseLDAJob, model: dict[str, Any], releases: dict[str, Any]
) -> dict[str, Any]:
    short = job.job_id.removeprefix("sparse-lda-")
    publish_markdown(
        artifact_key("sparse-lda", short, "release"),
        _summary(job, model, releases),
        f"sparse LDA summary of job {job.job_id}",
    )
    publish_model_link(
        artifact_key("sparse-lda", short, "model"),
        secure_sum.coordinator_store(job.workspace).path,
        steps.model_key(job.job_id),
    )
    arrays = ("direction", "mean_positive", "mean_negative")
    return {
        **{k: v for k, v in model.items() if k not in arrays},
        **{k: model[k].tolist() for k in arrays},
        "releases": releases,
        "model_key": steps.model_key(job.job_id),
        "threshold": job.threshold,
        "job_id": job.job_id,
    }


def summary_line(result: dict[str, Any]) -> str:
    """One line for the pipeline summary: method, privacy, features kept, ledger reuse."""
    budgets = [r["budget"] for r in result["releases"].values() if r["budget"] is not None]
    privacy = f"eps {result['epsilon']:g} per party" if result["private"] else "NOT private"
    text = (
        f"{result['method']}, {privacy}, {len(result['support'])} of "
        f"{len(result['features'])} features kept, {len(result['contributors'])} parties"
    )
    if budgets:
        text += ", eps spent " + ", ".join(
            f"{b['epsilon_spent']:g}/{b['epsilon_total']:g}" for b in budgets
        )
    if result["releases"] and all(r["reused"] for r in result["releases"].values()):
        text += " (releases reused)"
    return text


def sparse_lda_job(
    job_file: str = "jobs/sparse_lda_demo.json", workspace: str | None = None
) -> dict[str, Any]:
    """Import each party's source file, let each owner set its budget, then fit (demo entry).

    Each party's ``privacy_budget`` in the job file stands for its owner's decision about its
    table; the flow's options are the job file's ``sparse_lda`` section.
    """
    job = read_job(job_file)
    descriptors = []
    for party in job["parties"].values():
        ref = TableRef.from_dict(party["table"])
        load_table(party["source"], ref)
        if "privacy_budget" in party:
            steps.set_party_budget(ref, **party["privacy_budget"])
        descriptors.append(ref.to_dict())
    result = sparse_lda(descriptors, workspace=workspace, **job["sparse_lda"])
    print(f"job {result['job_id']}: {summary_line(result)}")
    return result


if __name__ == "__main__":
    sparse_lda_job(*sys.argv[1:2])
