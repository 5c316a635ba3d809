"""Flow ``label_dp_regression``: a regression model trained on label-DP noisy labels.

labels party                                              features party
                                    ◀── id-order digest ── sent unprompted at the start
check labels, refuse if over budget ── id-order digest ──▶ check features, compare digest
compare digests (refuse before computing or charging)
private prior ─▶ mechanism ─▶ noisy labels
(stored and charged once per table and parameters)
                                    ── noisy labels ────▶ train on own features, save model
optional:  evaluate on true labels ◀── predictions ────── (hold-out rows only)

More (the protocol, what each party learns, why): docs/protocols/label-dp.md.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from core.job_schema import LabelDPOptions
from core.preprocessing import PreprocessingSpec
from federation.workspace import channel_for, derive_job_id
from flows.local_run import run_pair
from flows.stage_options import keyword_options
from storage.descriptor import TableRef
from tasks import label_dp as steps
from tasks.charts import publish_training_charts
from tasks.loading import fingerprint
from tasks.reporting import artifact_key, publish_model_link, run_namer
from tasks.summaries import label_dp_summary


def _label_range(label_range: list[float] | None, labels: TableRef) -> tuple[float, float]:
    """The declared range: the parameter, else the labels descriptor's ``label_domain``."""
    if label_range is not None:
        if len(label_range) != 2:
            raise steps.LabelDPSetupError(f"label_range must be [low, high]; got {label_range}")
        return float(label_range[0]), float(label_range[1])
    if labels.label_domain:
        return float(min(labels.label_domain)), float(max(labels.label_domain))
    raise steps.LabelDPSetupError(
        "label_range is required (or a label_domain in the labels descriptor): the grid must "
        "be fixed before looking at the labels, so it cannot come from the data"
    )


def _release_details(release: dict[str, Any], evaluation: dict[str, Any]) -> list:
    """The mechanism's public figures (and a loss other than squared on true labels, not DP),
    as rows of the labels party's run summary."""
    s = release["summary"]
    return [
        ("how labels are randomised (mechanism)", f"{s['mechanism']} for {s['loss']} loss"),
        ("privacy split (epsilon)", f"{s['epsilon']:g} = {s['prior_epsilon']:.4g} (prior) + "
                          f"{s['label_epsilon']:.4g} (labels)"),
        ("what the labels were expected to look like (prior)", s["prior"]),
        ("label values considered (grid)",
         f"{s['grid_size']} points in [{s['grid_low']:g}, {s['grid_high']:g}]"),
        ("distinct values a released label can take (bins)", s["bins"]),
        ("chance a label is released as is (keep probability)",
         f"{s['keep_probability']:.4f}" if "keep_probability" in s else "-"),
        ("error the noise adds, expected under the prior (loss)", f"{s['expected_loss']:.6g}"),
        ("release", "reused, not charged again" if release["reused"] else "new, charged once"),
        *((f"{k.removeprefix('test_').replace('_', ' ')} on {evaluation['evaluated_on']} "
           "(not DP)", v) for k, v in evaluation.items() if k.endswith("_loss")),
    ]  # fmt: skip


@flow(name="label_dp_regression", flow_run_name=run_namer("label_dp_regression"))
@keyword_options(LabelDPOptions)
def label_dp_regression(
    features: dict[str, Any],
    labels: dict[str, Any],
    workspace: str | None = None,
    job_id: str | None = None,
    preprocessing: dict[str, Any] | None = None,
    *,
    options: LabelDPOptions,
) -> dict[str, Any]:
    """Train on epsilon-label-DP noisy labels, locally (both parties' ``label_dp_party``
    sides in this process); returns the model, the release and the budget.

    ``label_range`` (or the labels descriptor's ``label_domain``) fixes the public grid before
    any label is read. More: docs/protocols/label-dp.md.

    Args:
        features: Descriptor of the features party's aligned table.
        labels: Descriptor of the labels party's aligned table (its label column is protected).
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
        job_id: Job to continue; default derived from both tables' fingerprints and the options.
        preprocessing: The job's preprocessing (default: standardise), fitted by the features
            party on its own training rows.
    """
    spec = PreprocessingSpec.from_dict(preprocessing)
    features_ref, labels_ref = TableRef.from_dict(features), TableRef.from_dict(labels)
    job = _job(job_id or "pending", labels_ref, features_ref.party, options)
    steps.check_parameters(job)
    if job_id is None:
        tables = [[r.party, r.table, fingerprint(r)] for r in (labels_ref, features_ref)]
        described = {**job.release_parameters(), "holdout_fraction": job.holdout_fraction,
                     "seed": job.seed}  # fmt: skip
        if spec != PreprocessingSpec():  # another model, the same release
            described["preprocessing"] = spec.to_dict()
        job_id = derive_job_id("label-dp", {"tables": tables, **described})
    options = options.model_copy(update={"label_range": list(job.label_range)})
    released, trained = run_pair(
        labels_ref, features_ref,
        lambda own, peer, role: label_dp_party(
            own.to_dict(), role, peer, job_id, options, spec.to_dict()),
        workspace, job_id, ROLES,
    )  # fmt: skip
    return {
        "job_id": job_id,
        **{k: released[k] for k in ("rows", "release_key", "reused", "mechanism", "budget")},
        **{k: trained[k] for k in ("coefficients", "intercept", "model_key", "database")},
        "metrics": {**trained["metrics"], **released["metrics"]},
    }


def _job(job_id: str, labels: TableRef, features_party: str, options: LabelDPOptions) -> Any:
    """The labels party's job: the options, with the grid's range fixed before any label."""
    fields = options.model_dump(exclude={"label_range", "evaluate"})
    fields["label_range"] = _label_range(options.label_range, labels)
    return steps.LabelDPJob(job_id, channel_for(job_id), labels.party, features_party, **fields)


ROLES = ("labels", "features")


@flow(name="label_dp_party", flow_run_name=run_namer("label_dp_party"))
def label_dp_party(
    own: dict[str, Any],
    role: str,
    peer: str,
    job_id: str,
    options: LabelDPOptions,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One party's side of label-DP regression; its result holds only what that party may see.

    The features party trains for the release terms the labels party sends. A killed party
    re-runs it with the same arguments: the stored release is re-sent, never charged again.

    Args:
        own: Descriptor of this party's own aligned table.
        role: "labels" (holds the protected label column and the budget) or "features".
        peer: Name of the other party (as its certificate names it).
        job_id: Job name agreed between the two parties.
        options: The release and the regression (both parties pass the same).
        preprocessing: The job's preprocessing (default: standardise); only the features
            party uses it, on its own training rows.
    """
    spec = PreprocessingSpec.from_dict(preprocessing)
    if role not in ROLES:
        raise steps.LabelDPSetupError(f"role must be one of {ROLES}, got {role!r}")
    ref = TableRef.from_dict(own)
    if role == "features":
        return _features_side(job_id, ref, peer, options.evaluate, spec)
    job = _job(job_id, ref, peer, options)
    steps.check_parameters(job)
    checked = steps.check_labels(job, ref)  # fetches the peer's id-order digest meanwhile
    steps.check_alignment(job, ref)  # before anything is computed or charged
    release = steps.release_noisy_labels(job, ref)
    evaluation = steps.evaluate(job, ref) if options.evaluate else {}
    if evaluation:
        scope = f"{evaluation['test_rows']} rows, {evaluation['evaluated_on']}"
        publish_training_charts("label-dp", job_id, [], {scope: evaluation.pop("calibration")})
    details = _release_details(release, evaluation)
    label_dp_summary(job, ref, checked["rows"], release["budget"], evaluation, details)
    return {
        "job_id": job_id,
        "role": "labels",
        "rows": checked["rows"],
        "release_key": release["release_key"],
        "reused": release["reused"],
        "mechanism": release["summary"],
        "budget": release["budget"],
        "metrics": evaluation,
    }


def _features_side(
    job_id: str, ref: TableRef, peer: str, evaluate: bool, spec: PreprocessingSpec
) -> dict[str, Any]:
    """The features party's column: the terms, the alignment check, training on the release."""
    channel = channel_for(job_id)  # this side's, once
    steps.send_id_order(channel, peer, ref)  # unprompted: the release need not wait for it
    terms = steps.receive_terms(channel, peer, ref)
    job = steps.LabelDPJob.from_terms(channel, peer, ref.party, terms)
    checked = steps.check_features(job, ref)
    model = steps.train_model(job, ref, spec)
    if evaluate:
        steps.send_predictions(job, ref)
    publish_model_link(artifact_key("label-dp", job_id, "model"), ref.database, model["key"])
    return {
        "job_id": job_id,
        "role": "features",
        "rows": checked["rows"],
        **{k: model[k] for k in ("coefficients", "intercept", "metrics")},
        "model_key": model["key"],
        "database": ref.database,
    }
