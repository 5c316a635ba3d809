"""Flows ``score_vertical`` and ``score_local``: a stored model applied to new rows.

score_vertical (a model split across parties):
    guest, host ── PSI on the new tables ──▶ aligned new rows (same order on both sides)
    host ── X_h w_h (its score share only) ──▶ guest ── X_g w_g + b + shares ──▶ scores table
score_local (a model one party holds whole): the party scores its own new rows.

The model is the one promoted for the job (``privreg models promote``; the pipeline promotes
what it trains), or the training job named explicitly: never the newest by date. Scores land
in the scoring party's store as ``<table>_scored`` (id, score, probability or prediction, and
``in_training``: "train", "held out" or empty for a row the model's training never saw).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.align import psi_align
from storage.descriptor import TableRef
from storage.workspace import derive_job_id
from tasks import scoring as steps
from tasks.reporting import Quality, RunSummary, bytes_sent, job_name, publish_summary, run_namer


@flow(name="score_vertical", flow_run_name=run_namer("score_vertical"))
def score_vertical(
    guest: dict[str, Any],
    hosts: list[dict[str, Any]],
    job: str | None = None,
    model_job_id: str | None = None,
    min_rows: int = 1,
    workspace: str | None = None,
) -> dict[str, Any]:
    """Score new rows with a vertical model: each host sends only its score share.

    Args:
        guest: Descriptor of the guest's new table (the guest holds the intercept; labels
            optional, for an AUC).
        hosts: Descriptors of the hosts' new tables, one host (PSI is two-party).
        job: Job whose promoted vertical model scores (default: this run's job).
        model_job_id: Or the training job id whose model shares to use, explicitly.
        min_rows: Refuse to score fewer shared rows than this.
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
    """
    guest_ref = TableRef.from_dict(guest)
    host_refs = [TableRef.from_dict(h) for h in hosts]
    if len(host_refs) != 1:
        raise steps.ScoringError("score_vertical aligns the guest with exactly one host")
    if model_job_id is None:
        key = steps.promoted_model(guest_ref, job or job_name(), "vertical")
        model_job_id = key.split("/")[2]
    alignment = psi_align(guest, hosts[0], min_rows=min_rows, workspace=workspace)
    aligned_guest, aligned_host = (TableRef.from_dict(d) for d in alignment["aligned"])
    run = steps.ScoringJob(
        derive_job_id("score", {"model": model_job_id, "alignment": alignment["job_id"]}),
        model_job_id,
        guest_ref.party,
        workspace,
    )
    steps.host_score_share(run, aligned_host)
    scored = steps.guest_scores(
        run, aligned_guest, [aligned_host.party], f"{guest_ref.table}_scored"
    )
    _summary(run.job_id, {guest_ref.party: scored.rows, aligned_host.party: scored.rows},
             scored, [alignment["job_id"], run.job_id], workspace)  # fmt: skip
    return {**_result(scored), "job_id": run.job_id, "model_job_id": model_job_id,
            "alignment": alignment}  # fmt: skip


@flow(name="score_local", flow_run_name=run_namer("score_local"))
def score_local(
    table: dict[str, Any],
    model_key: str | None = None,
    job: str | None = None,
    model_flow: str = "horizontal",
) -> dict[str, Any]:
    """Score a party's new rows with a model it holds whole (horizontal, WALR, label DP,
    sparse LDA).

    Args:
        table: Descriptor of the party's new table (labels optional, for an AUC).
        model_key: The key of a model in the party's store, explicitly (privreg models list
            shows them); without it, the model promoted for ``job`` and ``model_flow``.
        job: Job whose promoted model scores (default: this run's job).
        model_flow: Which flow's promoted model: horizontal, walr, label_dp or sparse_lda.
    """
    ref = TableRef.from_dict(table)
    if model_key is None:
        model_key = steps.promoted_model(ref, job or job_name(), model_flow)
    scored = steps.local_scores(ref, model_key)
    run_id = derive_job_id("score", {"table": f"{ref.party}.{ref.table}", "model": model_key})
    _summary(run_id, {ref.party: scored.rows}, scored, [], None)
    return _result(scored)


def _result(scored: steps.ScoredRows) -> dict[str, Any]:
    return {
        "rows": scored.rows,
        "scores_table": scored.scores_table,
        "model_key": scored.model_key,
        "auc": scored.auc,
        "in_training": scored.in_training,
    }


def _summary(
    run_id: str,
    parties: dict[str, int],
    scored: steps.ScoredRows,
    jobs: list[str],
    workspace: str | None,
) -> None:
    quality = []
    if scored.auc is not None:
        quality = [Quality("AUC", scored.auc, 0.5, True, "new rows with labels")]
    publish_summary(
        RunSummary(
            run_id,
            parties,
            quality=quality,
            bytes_sent=bytes_sent(jobs, workspace) if jobs else {},
            rounds=1,
            details=[
                ("model", scored.model_key),
                ("scores table", scored.scores_table),
                ("rows the model trained on", scored.in_training["train"]),
                ("rows the model held out", scored.in_training["held out"]),
                ("rows new to the model", scored.in_training["unseen"]),
            ],
        )
    )
