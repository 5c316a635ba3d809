"""Flow ``walr``: one noisy label-weighted sum under Paillier, then logistic regression in clear.

labels party                                   features party
labels + budget check (refuse before compute)  features check ── id-order digest ──▶
compare digests
own key pair ── n, [[y]] ─────────────────────▶
                ◀──────────── [[X^T y + r]] ──  grid-encoded sums + own mask r, re-randomised
decrypt s + r, add noise, store + charge
                ── s + r + noise ─────────────▶ remove r, fit (L-BFGS), save the model
                ◀────────────── predictions ──  (only with evaluate=True)
AUC

A re-run on unchanged tables and release parameters reuses the stored release and charges
nothing; the labels party then only re-sends it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from core.dp.gaussian import validate_epsilon_delta
from core.paillier.randomness import DEFAULT_RANDOMIZER, randomizer_mode
from storage.descriptor import TableRef
from storage.workspace import derive_job_id
from tasks import walr as steps
from tasks.loading import fingerprint
from tasks.reporting import (
    artifact_key,
    markdown_table,
    publish_markdown,
    publish_model_link,
    run_namer,
)
from tasks.summaries import walr_summary


def _check_options(
    mode: str,
    clip_norm: float | None,
    l2: float,
    key_size: int,
    allow_insecure_key_size: bool,
    noise: bool,
    allow_noiseless_release_for_tests: bool,
) -> None:
    if mode not in steps.MODES:
        raise steps.WalrSetupError(f"mode must be one of {steps.MODES}, got {mode!r}")
    if mode == "clipped" and clip_norm is None:
        raise steps.WalrSetupError(
            "clipped mode needs clip_norm (e.g. a quantile of the features' row norms, which "
            "spends no label privacy)"
        )
    if mode == "binary" and clip_norm is not None:
        raise steps.WalrSetupError("clip_norm applies to clipped mode only; binary rows are 0/1")
    if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
        raise steps.WalrSetupError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    if not (math.isfinite(l2) and l2 > 0):
        raise steps.WalrSetupError(f"l2 must be finite and > 0 (noisy sums need it), got {l2!r}")
    steps.check_key_size(key_size, allow_insecure_key_size)
    if not noise and not allow_noiseless_release_for_tests:
        raise steps.WalrSetupError(
            "noise=False releases the exact label-weighted sum (no privacy); it is for tests "
            "only and needs allow_noiseless_release_for_tests=True"
        )


_CALIBRATION = {"binary": "exact delta for 0/1 shifts", "clipped": "zCDP bound"}


def _sigma_text(value: float | None) -> str:
    return "not valid for epsilon > 1" if value is None else f"{value:.6g}"


def _summary(
    job: steps.WalrJob,
    release: dict[str, Any],
    model: dict[str, Any],
    metrics: dict[str, Any],
    reused: bool,
) -> str:
    budget = release["budget"]
    rows = [
        {"quantity": "rows N (public)", "value": release["rows"]},
        {
            "quantity": "mode",
            "value": job.mode
            + (f", clip norm {job.clip_norm:g}" if job.clip_norm is not None else ""),
        },
        {"quantity": "L2 sensitivity", "value": f"{release['sensitivity']:.6g}"},
        {"quantity": "epsilon, delta of this release", "value": f"{job.epsilon:g}, {job.delta:g}"},
        {
            "quantity": f"sigma used (discrete Gaussian, {_CALIBRATION[job.mode]})",
            "value": f"{release['sigma']:.6g}" + ("" if job.noise else " (NOT added: test mode)"),
        },
        {
            "quantity": "sigma, analytic continuous Gaussian",
            "value": _sigma_text(release["sigma_analytic_continuous"]),
        },
        {
            "quantity": "sigma, classic sqrt(2 ln(1.25/delta)) S/epsilon",
            "value": _sigma_text(release["sigma_classic"]),
        },
        {"quantity": "release", "value": "reused, nothing charged" if reused else "new, charged"},
        {
            "quantity": f"budget of {budget['protected_table']}: epsilon spent / left",
            "value": f"{budget['epsilon_spent']:g} / {budget['epsilon_left']:g}",
        },
        {
            "quantity": f"budget of {budget['protected_table']}: delta spent / left",
            "value": f"{budget['delta_spent']:g} / {budget['delta_left']:g}",
        },
        {"quantity": "converged", "value": f"{model['converged']} ({model['n_iter']} iterations)"},
    ]
    if metrics.get("auc") is not None:
        auc = f"{metrics['auc']:.4f}"
        rows.append({"quantity": "AUC at the labels party (not DP)", "value": auc})
    return f"# WALR {job.job_id}\n\n" + markdown_table(rows)


@flow(name="walr", flow_run_name=run_namer("walr"))
def walr(
    features: dict[str, Any],
    labels: dict[str, Any],
    epsilon: float,
    delta: float,
    mode: str = "clipped",
    clip_norm: float | None = None,
    l2: float = 1e-3,
    key_size: int = 2048,
    workspace: str | None = None,
    job_id: str | None = None,
    allow_insecure_key_size: bool = False,
    noise: bool = True,
    evaluate: bool = False,
    protected_table: str | None = None,
    allow_noiseless_release_for_tests: bool = False,
    randomizer: str = DEFAULT_RANDOMIZER,
) -> dict[str, Any]:
    """Train WALR: (epsilon, delta)-label-DP logistic regression from one noisy sum.

    ``features`` and ``labels`` are descriptors of the two parties' PSI-aligned tables; the
    labels party uses only its label column, and charges its own source table (an aligned
    copy's budget is its source table's); ``protected_table``, if given, must name that table
    or the labels table, else the labels party refuses. ``evaluate=True`` sends the
    predictions to the labels party, which returns their AUC on the true labels: that reveals
    every row's prediction to the labels party and is not covered by the DP guarantee.
    ``noise=False`` (tests only) needs ``allow_noiseless_release_for_tests=True`` and the
    labels owner's policy (``privreg policy set ... --allow-noiseless-release``).
    ``randomizer`` picks the Paillier obfuscators: ``"full"`` (default, DCR only), ``"short"``
    (faster, extra assumption) or ``"standard"`` (textbook r^n); see core/paillier/randomness.py.

    Args:
        features: Descriptor of the features party's aligned table.
        labels: Descriptor of the labels party's aligned table (only its label column is used).
        epsilon: Epsilon of the one noisy label-weighted sum.
        delta: Delta of the one noisy label-weighted sum.
        mode: "clipped" (rows clipped to clip_norm) or "binary" (0/1 features).
        clip_norm: Row-norm bound of clipped mode, chosen without looking at the labels.
        l2: L2 penalty of the logistic regression (> 0).
        key_size: Paillier modulus bits of the labels party's key.
        workspace: Folder for the run's messages (default: var or PRIVREG_HOME).
        job_id: Job to continue; default derived from the tables and options.
        allow_insecure_key_size: Allow keys under 2048 bits (tests only).
        noise: Add the calibrated noise (False only for tests).
        evaluate: Send predictions to the labels party for an AUC (not covered by the DP).
        protected_table: The labels table or its source (checked by the labels party).
        allow_noiseless_release_for_tests: Confirms noise=False (tests only).
        randomizer: Paillier obfuscators: "full" (default), "short" or "standard".
    """
    randomizer_mode(randomizer)
    validate_epsilon_delta(epsilon, delta)
    _check_options(
        mode,
        clip_norm,
        l2,
        key_size,
        allow_insecure_key_size,
        noise,
        allow_noiseless_release_for_tests,
    )
    features_ref, labels_ref = TableRef.from_dict(features), TableRef.from_dict(labels)
    if features_ref.party == labels_ref.party:
        raise steps.WalrSetupError(f"both tables belong to {features_ref.party!r}")
    labels_view = steps.labels_only(labels_ref)
    prints = {"features": fingerprint(features_ref), "labels": fingerprint(labels_view)}
    protected = protected_table or labels_ref.table
    release = {"epsilon": epsilon, "delta": delta, "mode": mode, "clip_norm": clip_norm}
    if job_id is None:
        described = {
            "features": [features_ref.party, features_ref.table, prints["features"]],
            "labels": [labels_ref.party, labels_ref.table, labels_ref.label_column],
            "labels_fingerprint": prints["labels"],
            "shaping": [noise, l2, key_size, protected],
        }
        job_id = derive_job_id("walr", {**described, **release})
    job = steps.WalrJob(
        job_id=job_id,
        workspace=workspace,
        features_party=features_ref.party,
        labels_party=labels_ref.party,
        protected_table=protected,
        labels_fingerprint=prints["labels"],
        features_fingerprint=prints["features"],
        noise=noise,
        noiseless_for_tests=not noise and allow_noiseless_release_for_tests,
        randomizer=randomizer,
        **release,
    )
    checked = steps.check_labels_and_budget(job, labels_ref)  # before any computation
    shape = steps.check_features(job, features_ref)
    job = replace(job, columns=shape["columns"])  # the shape the labels party will decrypt
    steps.check_alignment(job, labels_ref)
    if checked["reused"]:
        get_run_logger().info("unchanged inputs: reusing the stored release (nothing charged)")
    else:
        steps.encrypt_labels(job, labels_ref, key_size, allow_insecure_key_size)
        steps.masked_sums(job, features_ref)
        steps.release_noisy_sums(job, labels_ref)
    sent = steps.send_release(job, labels_ref)
    model = steps.train(job, features_ref, l2)
    metrics: dict[str, Any] = {}
    if evaluate:
        steps.send_predictions(job, features_ref)
        metrics = steps.evaluate(job, labels_ref)
    publish_model_link(
        artifact_key("walr", job_id, "model"), features_ref.database, model["model_key"]
    )
    publish_markdown(
        artifact_key("walr", job_id, "release"),
        _summary(job, sent, model, metrics, checked["reused"]),
        f"WALR release and model of job {job_id}",
    )
    walr_summary(
        job_id,
        features_ref,
        labels_ref,
        shape["rows"],
        sent["budget"],
        metrics,
        workspace,
        sent["release_job_id"],
    )
    return {
        "job_id": job_id,
        "reused_release": checked["reused"],
        "release_job_id": sent["release_job_id"],
        "rows": shape["rows"],
        "features": list(model["coefficients"]),
        "coefficients": model["coefficients"],
        "intercept": model["intercept"],
        "converged": model["converged"],
        "n_iter": model["n_iter"],
        "noisy_sum": model["noisy_sum"],
        "granularity": model["granularity"],
        "sensitivity": sent["sensitivity"],
        "sigma": sent["sigma"],
        "sigma_analytic_continuous": sent["sigma_analytic_continuous"],
        "sigma_classic": sent["sigma_classic"],
        "epsilon": epsilon,
        "delta": delta,
        "budget": sent["budget"],
        "metrics": metrics,
        "model_key": model["model_key"],
        "database": str(Path(features_ref.database)),
    }
