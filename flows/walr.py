"""Flow ``walr``: one noisy label-weighted sum under Paillier, then logistic regression in clear.

labels party                                   features party
labels + budget check (refuse before compute)  features check ── id-order digest ──▶
compare digests
own key pair ── n, [[y]] ─────────────────────▶
                ◀──────────── [[X^T y + r]] ──  grid-encoded sums + own mask r, re-randomised
decrypt s + r, add noise, store + charge
                ── s + r + noise ─────────────▶ remove r, fit (L-BFGS), save the model
                ◀─ scores of held-out rows ──  (with a hold-out, or evaluate=True: all rows)
AUC, log-loss vs the class-prior baseline ──▶ summary

More (the protocol, what each party learns, why): docs/protocols/walr.md.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from core import test_switches
from core.dp.gaussian import validate_epsilon_delta
from core.job_schema import WalrOptions
from core.paillier.keys import check_key_size
from core.preprocessing import PreprocessingSpec
from federation.workspace import channel_for, derive_job_id
from flows.local_run import run_pair
from flows.stage_options import keyword_options
from storage.descriptor import TableRef
from tasks import walr as steps
from tasks.loading import fingerprint
from tasks.reporting import artifact_key, publish_model_link, run_namer
from tasks.summaries import walr_summary


def _check_options(options: WalrOptions) -> None:
    """What the schema cannot say alone: the mode's clip norm, a positive ridge, the key."""
    validate_epsilon_delta(options.epsilon, options.delta)
    if not options.holdout_fraction < 0.5:
        raise steps.WalrSetupError(
            f"holdout_fraction must be in [0, 0.5), got {options.holdout_fraction}"
        )
    mode, clip_norm = options.mode, options.clip_norm
    if mode == "clipped" and clip_norm is None:
        raise steps.WalrSetupError(
            "clipped mode needs clip_norm (e.g. a quantile of the features' row norms, which "
            "spends no label privacy)"
        )
    if mode == "binary" and clip_norm is not None:
        raise steps.WalrSetupError("clip_norm applies to clipped mode only; binary rows are 0/1")
    if clip_norm is not None and not math.isfinite(clip_norm):
        raise steps.WalrSetupError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    if not (math.isfinite(options.l2) and options.l2 > 0):
        raise steps.WalrSetupError(
            f"l2 must be finite and > 0 (noisy sums need it), got {options.l2!r}"
        )
    check_key_size(options.key_size)  # below 2048 bits: this process's opt-in (tests only)


def _noiseless_for_tests(noise: bool, job_id: str) -> bool:
    """Whether this release is exact: ``noise=False`` is refused unless the test switch
    ``PRIVREG_TEST_NOISELESS`` in this process's environment names the job (no flow
    parameter or job-file key can confirm it), and the run then warns it is NOT private."""
    if noise:
        return False
    if not test_switches.noiseless(job_id):
        raise steps.WalrSetupError(
            "noise=False releases the exact label-weighted sum (no privacy); it is for tests "
            f"only and needs the test switch {test_switches.NOISELESS_VARIABLE}={job_id} in the "
            "environment"
        )
    get_run_logger().warning(
        "job %s: noise=False with %s naming this job: the label-weighted sum is released "
        "exactly; the output is NOT private (a test switch)",
        job_id,
        test_switches.NOISELESS_VARIABLE,
    )
    return True


def _sigma_text(value: float | None) -> str:
    return "not valid for epsilon > 1" if value is None else f"{value:.6g}"


def _release_details(job: steps.WalrJob, release: dict[str, Any], reused: bool) -> list:
    """The release's public figures, as rows of the labels party's run summary."""
    bound = {"binary": "exact delta for 0/1 shifts", "clipped": "zCDP bound"}[job.mode]
    clip = "" if job.clip_norm is None else f", clip norm {job.clip_norm:g}"
    sigma = f"{release['sigma']:.6g}" + ("" if job.noise else " (NOT added: test mode)")
    return [
        (
            "rows in the sum (public, N)",
            f"{release['rows']}, {release.get('held_out_rows', 0)} held out",
        ),
        ("how each row's reach is bounded (mode)", job.mode + clip),
        ("most one row can move the sum (L2 sensitivity)", f"{release['sensitivity']:.6g}"),
        ("privacy of this release (epsilon, delta)", f"{job.epsilon:g}, {job.delta:g}"),
        (f"noise added to each sum (sigma of a discrete Gaussian, {bound})", sigma),
        (
            "noise a continuous Gaussian would need (sigma, analytic)",
            _sigma_text(release["sigma_analytic_continuous"]),
        ),
        (
            "noise the classic bound would add (sigma, sqrt(2 ln(1.25/delta)) S/epsilon)",
            _sigma_text(release["sigma_classic"]),
        ),
        ("release", "reused, nothing charged" if reused else "new, charged"),
    ]


#: The labels party's public view of its release (no value of it), from what it sent.
_RELEASE_FACTS = (
    "release_job_id",
    "sensitivity",
    "sigma",
    "sigma_analytic_continuous",
    "sigma_classic",
    "budget",
)


@flow(name="walr", flow_run_name=run_namer("walr"))
@keyword_options(WalrOptions)
def walr(
    features: dict[str, Any],
    labels: dict[str, Any],
    workspace: str | None = None,
    job_id: str | None = None,
    preprocessing: dict[str, Any] | None = None,
    *,
    options: WalrOptions,
) -> dict[str, Any]:
    """Train WALR: (epsilon, delta)-label-DP logistic regression from one noisy sum, locally:
    both parties' ``walr_party`` sides in this process.

    The labels party charges its own source table. ``evaluate=True`` (without a hold-out)
    shows it every row's score, outside the DP guarantee. More: docs/protocols/walr.md.

    Args:
        features: Descriptor of the features party's aligned table.
        labels: Descriptor of the labels party's aligned table (only its label column is used).
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
        job_id: Job to continue; default derived from the tables and options.
        preprocessing: The job's preprocessing (default: standardise), fitted by the features
            party on its own training rows before clipping; binary mode never scales.
    """
    spec = PreprocessingSpec.from_dict(preprocessing)
    _check_options(options)
    features_ref, labels_ref = TableRef.from_dict(features), TableRef.from_dict(labels)
    if features_ref.party == labels_ref.party:  # before anything is read or fingerprinted
        raise steps.WalrSetupError(f"both tables belong to {features_ref.party!r}")
    protected = options.protected_table or labels_ref.table
    options = options.model_copy(update={"protected_table": protected})
    if job_id is None:
        described = {
            "features": [
                features_ref.party, features_ref.table,
                steps.features_fingerprint(features_ref, spec),
            ],
            "labels": [labels_ref.party, labels_ref.table, labels_ref.label_column],
            "labels_fingerprint": fingerprint(steps.labels_only(labels_ref)),
            "shaping": [options.noise, options.l2, options.key_size, protected],
            **({"holdout_fraction": options.holdout_fraction} if options.holdout_fraction else {}),
            **options.model_dump(include={"epsilon", "delta", "mode", "clip_norm"}),
        }  # fmt: skip
        job_id = derive_job_id("walr", described)
    labels_side, features_side = run_pair(
        labels_ref, features_ref,
        lambda own, peer, role: walr_party(
            own.to_dict(), role, peer, job_id, options, spec.to_dict()),
        workspace, job_id, ROLES,
    )  # fmt: skip
    facts = {k: v for k, v in features_side.items() if k not in ("role", "job_id", "rows")}
    return {
        **{k: v for k, v in labels_side.items() if k != "role"},
        **facts,
        "epsilon": options.epsilon,
        "delta": options.delta,
    }


ROLES = ("labels", "features")


@flow(name="walr_party", flow_run_name=run_namer("walr_party"))
def walr_party(
    own: dict[str, Any],
    role: str,
    peer: str,
    job_id: str,
    options: WalrOptions,
    preprocessing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One party's side of WALR; its result holds only what that party may see.

    A killed party re-runs it with the same arguments and resumes: sent messages stand, a
    stored release is re-sent, never charged again.

    Args:
        own: Descriptor of this party's own aligned table.
        role: "labels" (holds the label column, the key and the budget) or "features".
        peer: Name of the other party (as its certificate names it).
        job_id: Job name agreed between the two parties.
        options: The release and the fit (both parties pass the same).
        preprocessing: The job's preprocessing (default: standardise); only the features
            party uses it, on its own training rows.
    """
    spec = PreprocessingSpec.from_dict(preprocessing)
    if role not in ROLES:
        raise steps.WalrSetupError(f"role must be one of {ROLES}, got {role!r}")
    _check_options(options)
    ref = TableRef.from_dict(own)
    if role == "labels":  # the features' fingerprint arrives as a message
        parties, protected = (peer, ref.party), options.protected_table or ref.table
        prints = (fingerprint(steps.labels_only(ref)), "")
    else:
        parties, protected = (ref.party, peer), ""
        prints = ("", steps.features_fingerprint(ref, spec))
    if parties[0] == parties[1]:
        raise steps.WalrSetupError(f"both tables belong to {parties[0]!r}")
    # the public job both parties hold; its channel is this side's, built once and handed down
    job = steps.WalrJob(
        job_id,
        channel_for(job_id),
        *parties,
        protected_table=protected,
        labels_fingerprint=prints[0],
        features_fingerprint=prints[1],
        noiseless_for_tests=_noiseless_for_tests(options.noise, job_id),
        preprocessing=spec,
        **options.model_dump(exclude={"l2", "evaluate", "protected_table"}),
    )
    scored = options.evaluate or options.holdout_fraction > 0
    if role == "labels":
        return _labels_side(job, ref, scored)
    return _features_side(job, ref, options.l2, scored)


def _labels_side(job: steps.WalrJob, ref: TableRef, evaluate: bool) -> dict[str, Any]:
    """The labels party's column: refuse before computing, release once, re-send on re-runs."""
    job = replace(job, **steps.receive_features_facts(job, ref))  # names the release key
    checked = steps.check_labels_and_budget(job, ref)  # before any computation
    steps.check_alignment(job, ref)
    steps.send_plan(job, ref, checked["reused"])
    if checked["reused"]:  # its key names both tables' fingerprints: the same inputs
        get_run_logger().info("unchanged inputs: reused the stored release (nothing charged)")
    else:
        steps.encrypt_labels(job, ref)
    steps.release_noisy_sums(job, ref)  # a stored release is kept as it is
    sent = steps.send_release(job, ref)
    metrics = steps.evaluate(job, ref) if evaluate else {}
    details = _release_details(job, sent, checked["reused"])
    walr_summary(
        job, ref, checked["rows"], sent["budget"], metrics, sent["release_job_id"], details
    )
    return {
        "job_id": job.job_id,
        "role": "labels",
        "rows": checked["rows"],
        "reused_release": checked["reused"],
        **{k: sent[k] for k in _RELEASE_FACTS},
        "metrics": metrics,
    }


def _features_side(job: steps.WalrJob, ref: TableRef, l2: float, evaluate: bool) -> dict[str, Any]:
    """The features party's column: mask the encrypted sums if asked, then fit in the clear."""
    shape = steps.check_features(job, ref)
    if steps.receive_plan(job, ref):
        steps.masked_sums(job, ref)
    model = steps.train(job, ref, l2)
    if evaluate:
        steps.send_predictions(job, ref)
    publish_model_link(artifact_key("walr", job.job_id, "model"), ref.database, model["model_key"])
    return {
        "job_id": job.job_id,
        "role": "features",
        "rows": shape["rows"],
        "features": list(model["coefficients"]),
        **model,  # its own, fitted on the (DP) noisy sum
        "database": str(Path(ref.database)),
    }
