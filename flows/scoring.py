"""Flows ``score_vertical`` and ``score_local``: a stored model applied to new rows.

score_vertical (a model split across parties):
    guest, host ── PSI on the new tables ──▶ aligned new rows (same order on both sides)
    host ── X_h w_h (its score share only) ──▶ guest ── X_g w_g + b + shares ──▶ scores table
score_local (a model one party holds whole): the party scores its own new rows.

Scores land in the scoring party's store as ``<table>_scored`` (id, score, probability);
the summary gives the row counts and, where the new table has labels, the AUC.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.align import psi_align
from storage.descriptor import TableRef
from storage.workspace import derive_job_id
from tasks import scoring as steps
from tasks.reporting import Quality, RunSummary, bytes_sent, publish_summary, run_namer


@flow(name="score_vertical", flow_run_name=run_namer("score_vertical"))
def score_vertical(
    guest: dict[str, Any],
    hosts: list[dict[str, Any]],
    model_job_id: str | None = None,
    min_rows: int = 1,
    workspace: str | None = None,
) -> dict[str, Any]:
    """Score new rows with a vertical model: each host sends only its score share.

    Args:
        guest: Descriptor of the guest's new table (the guest holds the intercept; labels
            optional, for an AUC).
        hosts: Descriptors of the hosts' new tables, one host (PSI is two-party).
        model_job_id: Training job whose model slices to use (default: the guest's newest).
        min_rows: Refuse to score fewer shared rows than this.
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
    """
    guest_ref = TableRef.from_dict(guest)
    host_refs = [TableRef.from_dict(h) for h in hosts]
    if len(host_refs) != 1:
        raise steps.ScoringError("score_vertical aligns the guest with exactly one host")
    model_job_id = model_job_id or steps.latest_vertical_job(guest_ref)
    alignment = psi_align(guest, hosts[0], min_rows=min_rows, workspace=workspace)
    aligned_guest, aligned_host = (TableRef.from_dict(d) for d in alignment["aligned"])
    job = steps.ScoringJob(
        derive_job_id("score", {"model": model_job_id, "alignment": alignment["job_id"]}),
        model_job_id,
        guest_ref.party,
        workspace,
    )
    steps.host_score_share(job, aligned_host)
    result = steps.guest_scores(job, aligned_guest, [aligned_host.party])
    publish_summary(
        RunSummary(
            job.job_id,
            {guest_ref.party: result["rows"], aligned_host.party: result["rows"]},
            quality=_quality(result),
            bytes_sent=bytes_sent([alignment["job_id"], job.job_id], workspace),
            rounds=1,
            details=[("model job", model_job_id), ("scores table", result["scores_table"])],
        )
    )
    return {**result, "job_id": job.job_id, "model_job_id": model_job_id, "alignment": alignment}


@flow(name="score_local", flow_run_name=run_namer("score_local"))
def score_local(
    table: dict[str, Any], model_key: str | None = None, model_prefix: str = "horizontal/"
) -> dict[str, Any]:
    """Score a party's new rows with a model it holds whole (WALR, label DP, horizontal).

    Args:
        table: Descriptor of the party's new table (labels optional, for an AUC).
        model_key: Key of the model in the party's store (see privreg models list).
        model_prefix: Without model_key, the newest model whose key starts with this.
    """
    ref = TableRef.from_dict(table)
    model_key = model_key or steps.latest_model(ref, model_prefix)
    result = steps.local_scores(ref, model_key)
    publish_summary(
        RunSummary(
            f"score-{ref.party}-{ref.table}",
            {ref.party: result["rows"]},
            quality=_quality(result),
            rounds=1,
            details=[("model", model_key), ("scores table", result["scores_table"])],
        )
    )
    return {**result, "model_key": model_key}


def _quality(result: dict[str, Any]) -> list[Quality]:
    if result["auc"] is None:
        return []
    return [Quality("AUC", result["auc"], 0.5, True, "new rows with labels")]
