"""Flows ``score_vertical`` and ``score_local``: a stored model applied to new rows.

score_vertical_party (a model split across parties: one side per party):
    guest ── the training job whose shares score ──▶ hosts
    guest ── the alignment standing for its table ──▶ host ── the same here, or not ──▶ guest
    guest, host ── PSI on the new tables, unless both named one ──▶ aligned new rows
    host ── X_h w_h (its score share only) ──▶ guest ── X_g w_g + b + shares ──▶ scores table
score_vertical runs those sides locally; score_local (a model one party holds whole): the
party scores its own new rows. More (what each party learns, why): docs/protocols/scoring.md.
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from prefect import flow

from core.job_schema import PsiOptions, ScoreOptions
from federation.workspace import channel_for, derive_job_id
from flows.align import psi_align_party
from flows.local_run import run_pair
from storage.descriptor import TableRef
from tasks import psi as psi_steps
from tasks import scoring as steps
from tasks.loading import fingerprint
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
    """Score new rows with a vertical model, locally (both ``score_vertical_party`` sides in
    this process): each host sends only its score share.

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
    job = job or job_name()
    if model_job_id is None:
        key = steps.promoted_model(guest_ref, job, "vertical")
        model_job_id = key.split("/")[2]
    tables = [f"{r.party}.{r.table}.{fingerprint(r)}" for r in (guest_ref, *host_refs)]
    job_id = derive_job_id("score", {"model": model_job_id, "tables": tables})
    parties = {"guest": guest_ref.party, "hosts": [h.party for h in host_refs], "job_id": job_id}
    options = ScoreOptions(model_job=job, min_rows=min_rows)
    result, _ = run_pair(
        guest_ref, host_refs[0],
        lambda own, _, role: score_vertical_party(
            own.to_dict(), role, **parties, options=options, model_job_id=model_job_id),
        workspace, job_id, ("guest", "host"),
    )  # fmt: skip
    scored = steps.ScoredRows(**{f.name: result[f.name] for f in fields(steps.ScoredRows)})
    rows = {guest_ref.party: scored.rows, host_refs[0].party: scored.rows}
    _summary(job_id, rows, scored, [job_id, f"{job_id}-psi"], workspace)
    return result


@flow(name="score_vertical_party", flow_run_name="score_vertical {job_id}: {role}")
def score_vertical_party(
    own: dict[str, Any],
    role: str,
    guest: str,
    hosts: list[str],
    job_id: str,
    options: ScoreOptions,
    model_job_id: str | None = None,
) -> dict[str, Any]:
    """One party's side of scoring new rows with a vertical model it holds a share of: a host
    sends only its score share, the guest stores ``<table>_scored``.

    Args:
        own: Descriptor of this party's new table.
        role: "guest" (holds the intercept, stores the scores) or "host".
        guest: The guest's party name.
        hosts: The hosts' party names (one: PSI is two-party).
        job_id: The scoring job's name, agreed by every party.
        options: The job whose promoted vertical model scores (the guest's choice), and the
            fewest shared rows scored.
        model_job_id: Or the training job id whose shares score, explicitly (the guest's).
    """
    ref = TableRef.from_dict(own)
    if role not in ("guest", "host") or len(hosts) != 1:
        raise steps.ScoringError(f"role must be guest or host (not {role!r}), with one host")
    if role == "guest":
        if not model_job_id:
            key = steps.promoted_model(ref, options.model_job, "vertical")
            model_job_id = key.split("/")[2]
        run = steps.ScoringJob(job_id, model_job_id, guest, channel_for(job_id))
        steps.announce_model(run, ref, hosts)
        aligned = _align(run, ref, hosts[0], options.min_rows)
        scored = steps.guest_scores(run, aligned, hosts, f"{ref.table}_scored")
        return {**asdict(scored), "job_id": job_id, "model_job_id": model_job_id}
    run = steps.ScoringJob(job_id, "", guest, channel_for(job_id))
    run = replace(run, model_job_id=steps.announced_model(run, ref))
    rows = steps.host_score_share(run, _align(run, ref, guest, options.min_rows))
    return {"job_id": job_id, "rows": rows, "model_job_id": run.model_job_id}


def _align(run: steps.ScoringJob, ref: TableRef, peer: str, min_rows: int) -> TableRef:
    """This party's new rows aligned with ``peer``'s: the standing alignment of both tables
    where the guest and the host name the same one (no PSI rerun), else the scoring job's own
    PSI (``<job_id>-psi``, reused when the tables are unchanged)."""
    if steps.agree_alignment(run, ref, peer, psi_steps.current_alignment(ref, min_rows)):
        return ref.with_table(psi_steps.aligned_table_name(ref))
    psi = PsiOptions(min_rows=min_rows)
    aligned = psi_align_party(ref.to_dict(), peer, f"{run.job_id}-psi", psi)
    return TableRef.from_dict(aligned["aligned"])


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
    return asdict(scored)


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
