"""Each flow's one summary: gathers its figures and hands them to ``reporting.publish_summary``.

More: docs/reporting.md (what a run publishes, and why).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pandas as pd
from prefect import get_run_logger, task

from core.charts import exact_auc
from core.horizontal_lr import decision_function, predict_proba
from core.outcomes import BELOW_BASELINE
from core.preprocessing import FittedPreprocessing
from core.sparse_lda.model import LinearDiscriminant
from core.vertical_lr.schedule import Schedule
from federation.workspace import channel_for
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore
from tasks.charts import held_out_roc
from tasks.policy import PARTY_STEP
from tasks.reporting import (
    BudgetLine,
    Quality,
    RunSummary,
    bytes_sent,
    kib,
    loss_noise_column,
    publish_summary,
)

_EPS = 1e-15


def log_loss(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean binary cross-entropy of 0/1 ``labels`` (numpy: no scikit-learn import in a job)."""
    p = np.clip(probabilities, _EPS, 1 - _EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def _auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    return exact_auc(labels, scores) if len(set(labels.tolist())) == 2 else None


def _training_mean(
    ref: TableRef, train_rows: list[int], eval_rows: list[int]
) -> tuple[float, np.ndarray]:
    """The labels party's plain predictor, the training rows' mean label, and the labels it is
    evaluated on (every row when there is no split)."""
    frame = PartyStore.of(ref).read_table(ref, allow_missing=True)  # the labels only
    labels = frame[ref.label_column].to_numpy(dtype=float)
    mean = float(np.mean(labels[train_rows])) if len(train_rows) else float(np.mean(labels))
    return mean, labels[eval_rows] if len(eval_rows) else labels


@task(name="label-rate-baseline", task_run_name="{ref.party}: baseline on own labels", **PARTY_STEP)
def label_rate_baseline(
    ref: TableRef, train_rows: list[int], eval_rows: list[int]
) -> dict[str, float | None]:
    """The plain baseline at the labels party: predict the training rows' positive rate for
    every evaluated row (AUC 0.5 by construction, log-loss of that constant)."""
    rate, evaluated = _training_mean(ref, train_rows, eval_rows)
    constant = np.full(len(evaluated), rate)
    return {"auc": 0.5, "log_loss": log_loss(evaluated, constant), "rate": rate}


def holdout_split(rows: int, fraction: float, seed: str) -> tuple[np.ndarray, np.ndarray]:
    """``(training rows, held-out rows)`` of a party's ``rows`` rows: the vertical schedule's
    split (the one rule, :func:`core.holdout.seeded_holdout_rows`), seeded by a public text the
    parties agree on (a job id), so they derive the same rows without a message. Fraction 0:
    every row trains."""
    if fraction == 0:
        return np.arange(rows), np.arange(0)
    number = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big")
    schedule = Schedule(rows, max(rows, 1), number, fraction)
    return schedule.train_rows, schedule.holdout_rows


def holdout_scope(held_out: int, rows: int) -> str:
    """How the quality figures were obtained, said plainly (in-sample when nothing is held out)."""
    return f"{held_out} held-out rows" if held_out else f"all {rows} training rows (in-sample)"


def classifier_figures(
    labels: np.ndarray,
    probabilities: np.ndarray,
    training_rate: float,
    scores: np.ndarray | None = None,
) -> dict[str, Any]:
    """AUC and log-loss of a classifier on the evaluated rows next to the class-prior
    baseline (the training rows' positive rate predicted for every row: AUC 0.5 and the
    log-loss of that constant). Aggregates only: this is what leaves the labels' holder."""
    return {
        "evaluated_rows": int(labels.size),
        "auc": _auc(labels, probabilities if scores is None else scores),
        "log_loss": log_loss(labels, probabilities),
        "baseline_auc": 0.5,
        "baseline_log_loss": log_loss(labels, np.full(labels.size, training_rate)),
        "roc": held_out_roc(labels, probabilities if scores is None else scores),
    }


@task(name="evaluate-model", task_run_name="{ref.party}: evaluate on own rows", **PARTY_STEP)
def evaluate_own_rows(
    ref: TableRef, model: dict[str, Any], holdout_fraction: float, job_id: str
) -> dict[str, Any]:
    """A party scores its own held-out rows (all its rows, in-sample, when none are held out)
    with the horizontal model every party holds whole; returns aggregates only. The model's
    fitted transform (``preprocessing``, ``core.preprocessing``) is applied to the stored
    values first."""
    stats = model.get("preprocessing")
    fitted = None if stats is None else FittedPreprocessing.from_dict(stats)
    frame = PartyStore.of(ref).read_table(ref, allow_missing=fitted is not None)
    labels = frame[ref.label_column].to_numpy(dtype=float)
    train, held_out = holdout_split(len(labels), holdout_fraction, job_id)
    evaluated = held_out if held_out.size else train
    features = list(model["features"])
    weights = [float(model["coefficients"][f]) for f in features]
    packed = np.asarray([*weights, model["intercept"]], dtype=float)
    X = model_matrix(frame, features, fitted)[evaluated]
    figures = classifier_figures(
        labels[evaluated],
        predict_proba(packed, X),
        float(np.mean(labels[train])),
        decision_function(packed, X),
    )
    return {"rows": len(labels), **log_figures(ref.party, figures, held_out.size, len(labels))}


def model_matrix(
    frame: pd.DataFrame, features: list[str], fitted: FittedPreprocessing | None, where: str = ""
) -> np.ndarray:
    """``features`` of a party's rows as a model trained with ``fitted`` sees them: its
    imputation and scaling applied to the stored values first (none: the values as stored)."""
    if fitted is None:
        return frame.loc[:, features].to_numpy(dtype=float)
    X = fitted.transform(frame.loc[:, fitted.input_names].to_numpy(dtype=float), where or "table")
    return X[:, [fitted.output_names.index(f) for f in features]]


def log_figures(party: str, figures: dict[str, Any], held_out: int, rows: int) -> dict[str, Any]:
    """The evaluating party's one log line: its figures beside the baseline, on which rows
    (:func:`holdout_scope`); returns the figures with their ``scope``."""
    scope = holdout_scope(held_out, rows)
    auc = "-" if figures["auc"] is None else f"{figures['auc']:.4f}"
    get_run_logger().info(
        "%s: AUC %s, log-loss %.4f (class-prior baseline %.4f) on %s",
        party, auc, figures["log_loss"], figures["baseline_log_loss"], scope,
    )  # fmt: skip
    return {"scope": scope, **figures}


def _classifier_quality(metrics: dict[str, Any], baseline: dict[str, Any], rows: str) -> list:
    return [
        Quality("AUC", metrics.get("auc"), baseline.get("auc"), True, rows),
        Quality("log-loss", metrics.get("log_loss"), baseline.get("log_loss"), False, rows),
    ]


def _round_bytes(job_id: str, workspace: str | None) -> dict[int, int]:
    """Bytes that crossed in each round of a job (every run of it), from the channel's log as
    this party sees it (a party's own folder holds what it sent and received)."""
    totals: dict[int, int] = {}
    for record in channel_for(job_id, workspace).log():
        totals[record.round] = totals.get(record.round, 0) + record.size
    return totals


def horizontal_rounds(
    job_id: str, history: list[dict[str, Any]], workspace: str | None = None
) -> list[dict[str, Any]]:
    """Horizontal LR's rounds table, one row per committed round of the coordinator's
    ``history``; bytes from ``workspace``'s log (None: this side's own channel)."""
    traffic, now = _round_bytes(job_id, workspace), current_attempt()
    return [
        {
            "round": e["round"],
            "loss": e["loss"],
            "seconds": e["seconds"],
            "survivors": len(e["survivors"]),
            "parties": ", ".join(e["survivors"]),
            "max weight change": e["change"],
            "KiB sent": kib(traffic.get(e["round"], 0)),
            **loss_noise_column(e),
            **attempt_columns(e.get("attempt"), now),
        }
        for e in history
    ]


# ---------------------------------------------------------------------------------------------
# Per flow


def psi_summary(
    job_id: str, refs: list[TableRef], set_sizes: list[int], shared: int, workspace: str | None
) -> dict[str, Any]:
    return publish_summary(
        RunSummary(
            job_id,
            {ref.party: int(n) for ref, n in zip(refs, set_sizes, strict=True)},
            bytes_sent=bytes_sent([job_id], workspace),
            rounds=1,
            details=[("shared rows", int(shared))],
        )
    )


def current_attempt() -> str:
    """Which attempt of which flow run this is (``1a2b3c4d try 2``: a UI retry of the same run
    counts up); stored with each round so the rounds table says who ran it."""
    from prefect.runtime import flow_run

    return f"{str(flow_run.id or '-')[:8]} try {flow_run.run_count}"


def attempt_columns(attempt: str | None, now: str) -> dict[str, str]:
    """A rounds table's two columns for a round ``attempt`` ran (stored with the round; None
    for rounds stored before attempts were): that attempt, and "yes" when the attempt
    publishing the table (``now``, :func:`current_attempt`) reused it rather than ran it."""
    return {"attempt": attempt or "-", "reused": "yes" if attempt not in (None, now) else ""}


def _reused(history: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    reused = sum(1 for row in history if row.get("reused"))
    return [("rounds reused from earlier attempts", reused)] if reused else []


def vertical_round_history(job: Any) -> list[dict[str, Any]]:
    """Every finished round of a vertical job, from the key holder's store (so rounds finished
    before a retry are included), with the bytes that crossed in each, the attempt that ran
    it, and whether this attempt reused it."""
    artifacts = ArtifactStore(PartyStore(job.key_holder_database))
    prefix = f"vertical/{job.job_id}/"
    rows: dict[int, dict[str, Any]] = {}
    with artifacts.store.session():  # one opening of the database for the many small reads
        for key, *_ in artifacts.list(prefix):
            kind, _, number = key.removeprefix(prefix).rpartition("/")
            if kind not in ("loss", "holdout-loss", "round-metrics") or not number.isdigit():
                continue
            value = artifacts.get(key)
            entry = rows.setdefault(int(number), {"round": int(number)})
            entry.update(value if kind == "round-metrics" else {kind: value})
    traffic = _round_bytes(job.job_id, None)  # as this side sees its channel
    now = current_attempt()
    held_out = any("holdout-loss" in row for row in rows.values())
    return [
        {
            "round": r,
            "loss": rows[r].get("loss"),
            **({"held-out loss": rows[r].get("holdout-loss")} if held_out else {}),
            "gradient_norm": rows[r].get("gradient_norm"),
            "KiB sent": kib(traffic.get(r, 0)),
            "seconds": rows[r].get("seconds"),
            **attempt_columns(rows[r].get("attempt"), now),
        }
        for r in sorted(rows)
    ]


def vertical_summary(
    job: Any,
    guest: TableRef,
    hosts: list[TableRef],
    metrics: dict[str, Any],
    rounds_run: int,
    history: list[dict[str, Any]],
    outcome: str | None = None,
) -> dict[str, Any]:
    """The run's summary; ``history`` is :func:`vertical_round_history`'s table, which the
    flow has just read and published (not read again here); ``outcome`` is the run's verdict
    (e.g. "Below baseline: ...")."""
    schedule = job.schedule
    holdout = [int(r) for r in schedule.holdout_rows]
    scope = "held-out rows" if holdout else "training rows (in-sample)"
    baseline = label_rate_baseline(guest, [int(r) for r in schedule.train_rows], holdout)
    prefix = "holdout" if holdout else "train"
    quality = _classifier_quality(
        {"auc": metrics.get(f"{prefix}_auc"), "log_loss": metrics.get(f"{prefix}_log_loss")},
        baseline,
        scope,
    )
    rows = int(len(schedule.train_rows) + len(schedule.holdout_rows))
    return publish_summary(
        RunSummary(
            job.job_id,
            {ref.party: rows for ref in (guest, *hosts)},
            quality=quality,
            bytes_sent=bytes_sent([job.job_id], None),
            rounds=len(history),
            rounds_table=history,
            details=[
                *([("outcome", outcome)] if outcome else []),
                ("training rows", len(schedule.train_rows)),
                ("held-out rows", len(holdout)),
                ("rounds run in this attempt", rounds_run),
                *_reused(history),
                ("key holder", job.key_holder),
            ],
        )
    )


def walr_summary(
    job: Any,
    labels: TableRef,
    rows: int,
    budget: dict[str, Any],
    metrics: dict[str, Any],
    release_job_id: str | None,
    release: list[tuple[str, Any]],
) -> dict[str, Any]:
    """Quality: the labels party's figures on the rows it was sent scores for (held-out rows,
    or every row in-sample when nothing is held out), next to the class-prior
    baseline; ``release``: the release's public figures, as detail rows."""
    quality, details = [], list(release)
    if metrics.get("log_loss") is not None:
        baseline = {"auc": metrics["baseline_auc"], "log_loss": metrics["baseline_log_loss"]}
        quality = _classifier_quality(metrics, baseline, metrics["scope"])
        details.append(("rows scored at the labels party", metrics["evaluated_rows"]))
    jobs = [job.job_id, *([release_job_id] if release_job_id else [])]
    return _one_release_summary(job, labels, rows, budget, quality, jobs, details)


def label_dp_summary(
    job: Any,
    labels: TableRef,
    rows: int,
    budget: dict[str, Any],
    metrics: dict[str, Any],
    release: list[tuple[str, Any]],
) -> dict[str, Any]:
    """The labels party's summary of a label-DP release: its budget, the release's public
    figures, and the test MSE beside the mean-label baseline on the same held-out rows."""
    quality, holdout = [], [int(r) for r in job.holdout_rows(rows)]
    if metrics.get("test_mse") is not None:
        train = [int(r) for r in job.train_rows(rows)]
        baseline = label_mean_baseline(labels, train, holdout)
        scope = str(metrics.get("evaluated_on", "held-out rows"))
        quality = [Quality("MSE", metrics["test_mse"], baseline, False, scope)]
    split = [("training rows", rows - len(holdout)), ("held-out rows", len(holdout)), *release]
    return _one_release_summary(job, labels, rows, budget, quality, [job.job_id], split)


@task(name="label-mean-baseline", task_run_name="{ref.party}: baseline on own labels", **PARTY_STEP)
def label_mean_baseline(ref: TableRef, train_rows: list[int], eval_rows: list[int]) -> float:
    """The plain regression baseline at the labels party: the training rows' mean label
    predicted for every evaluated row; returns its mean squared error."""
    mean, evaluated = _training_mean(ref, train_rows, eval_rows)
    return float(np.mean((evaluated - mean) ** 2))


def _one_release_summary(
    job: Any,
    labels: TableRef,
    rows: int,
    budget: dict[str, Any],
    quality: list[Quality],
    jobs: list[str],
    details: list[tuple[str, Any]],
) -> dict[str, Any]:
    """The summary of a flow that releases once (WALR, label DP; ``job`` names its
    ``features_party``): both parties' aligned rows, the labels party's ledger, the traffic of
    ``jobs`` (as the labels party's channel saw it)."""
    return publish_summary(
        RunSummary(
            job.job_id,
            {job.features_party: rows, labels.party: rows},
            quality=quality,
            budgets=[BudgetLine.from_status(labels.party, budget)],
            bytes_sent=bytes_sent(dict.fromkeys(jobs), None),
            rounds=1,
            details=details,
        )
    )


def horizontal_quality(evaluations: dict[str, dict[str, Any]]) -> list[Quality]:
    """Each hospital's figures on its own evaluated rows and, over several hospitals, the
    row-weighted pooled log-loss (AUCs do not pool from per-hospital aggregates)."""
    quality = []
    for party, e in evaluations.items():
        scope = f"{party}'s {e['scope']}"
        quality += [
            Quality(f"AUC at {party}", e["auc"], e["baseline_auc"], True, scope),
            Quality(f"log-loss at {party}", e["log_loss"], e["baseline_log_loss"], False, scope),
        ]
    rows = sum(e["evaluated_rows"] for e in evaluations.values())
    if len(evaluations) > 1 and rows:
        pooled = {
            name: sum(e[name] * e["evaluated_rows"] for e in evaluations.values()) / rows
            for name in ("log_loss", "baseline_log_loss")
        }
        held_out = all("held-out" in e["scope"] for e in evaluations.values())
        scope = f"{rows} {'held-out' if held_out else 'training (in-sample)'} rows of all parties"
        quality.append(
            Quality(
                "log-loss, pooled", pooled["log_loss"], pooled["baseline_log_loss"], False, scope
            )
        )
    return quality


def horizontal_summary(
    job_id: str,
    refs: list[TableRef],
    model: dict[str, Any],
    rounds_run: int,
    workspace: str | None,
    holdout_fraction: float = 0.0,
) -> dict[str, Any]:
    """Quality: each party scores its own held-out rows (all its rows, in-sample, without a
    hold-out) with the shared final model and reports aggregates only; see
    :func:`horizontal_quality`."""
    evaluations = {r.party: evaluate_own_rows(r, model, holdout_fraction, job_id) for r in refs}
    quality = horizontal_quality(evaluations)
    outcome = _outcome([q for q in quality if q.metric.startswith("log-loss")])
    history = horizontal_rounds(job_id, model["history"], workspace)
    return publish_summary(
        RunSummary(
            job_id,
            {party: e["rows"] for party, e in evaluations.items()},
            quality=quality,
            bytes_sent=bytes_sent([job_id], workspace),
            rounds=len(history),
            rounds_table=history,
            details=[
                ("outcome", outcome),
                ("rounds run in this attempt", rounds_run),
                *_reused(history),
            ],
        )
    ) | {
        "outcome": outcome,
        "curves": {f"{p}'s {e['scope']}": e["roc"] for p, e in evaluations.items()},
    }


def _outcome(log_losses: list[Quality]) -> str:
    """'Below baseline: ...' when the (pooled) held-out log-loss is no better than the class
    prior's; the flow ends in the COMPLETED state of that name."""
    pooled = [q for q in log_losses if "pooled" in q.metric] or log_losses
    worse = [q for q in pooled if q.model is not None and q.baseline is not None]
    worse = [q for q in worse if q.model >= q.baseline]
    if not worse:
        return "trained"
    return f"{BELOW_BASELINE}: " + "; ".join(
        f"{q.metric} {q.model:.4f} >= the class prior's {q.baseline:.4f}" for q in worse
    )


def horizontal_party_summary(
    job_id: str, ref: TableRef, model: dict[str, Any], holdout_fraction: float
) -> dict[str, Any]:
    """One hospital's summary in party mode: its own figures only (it learns no other
    hospital's), its own traffic, the rounds of the model it kept."""
    evaluation = evaluate_own_rows(ref, model, holdout_fraction, job_id)
    return publish_summary(
        RunSummary(
            job_id,
            {ref.party: evaluation["rows"]},
            quality=horizontal_quality({ref.party: evaluation}),
            bytes_sent=bytes_sent([job_id], None),
            rounds=int(model["rounds"]),
        )
    ) | {"curves": {f"{ref.party}'s {evaluation['scope']}": evaluation["roc"]}}


@task(name="lda-accuracy", task_run_name="{ref.party}: classify own rows", **PARTY_STEP)
def lda_error_own_rows(ref: TableRef, model: dict[str, Any]) -> dict[str, Any]:
    """A party applies the sparse discriminant to its own rows: misclassification rate and
    the majority-class baseline's (aggregates only), and the ROC's operating points of its
    rows. The model's pooled statistics (``preprocessing``) are applied first, as in training."""
    stats = model.get("preprocessing")
    fitted = None if stats is None else FittedPreprocessing.from_dict(stats)
    frame = PartyStore.of(ref).read_table(ref, allow_missing=fitted is not None)
    labels = frame[ref.label_column].to_numpy(dtype=float)
    rule = LinearDiscriminant(
        np.asarray(model["direction"], dtype=float),
        np.asarray(model["mean_positive"], dtype=float),
        np.asarray(model["mean_negative"], dtype=float),
    )
    X = model_matrix(frame, list(model["features"]), fitted, f"party {ref.party}")
    positive = float(np.mean(labels))
    return {
        "rows": len(labels),
        "error": rule.error_rate(X, labels),
        "baseline_error": min(positive, 1 - positive),
        "roc": held_out_roc(labels, rule.decision_scores(X)),
    }


def sparse_lda_summary(
    job: Any,
    refs: list[TableRef],
    model: dict[str, Any],
    releases: dict[str, Any],
    holdout: list[dict[str, int]] | None = None,
    workspace: str | None = None,
) -> dict[str, Any]:
    """In-sample error at each party and, with a hold-out, the error on every party's held-out
    rows (from each party's counts) next to predicting the held-out rows' majority class;
    ``workspace``: the local run's shared folder, whose log holds every party's bytes."""
    errors = {ref.party: lda_error_own_rows(ref, model) for ref in refs}
    quality = [
        Quality(
            f"misclassification at {party}",
            e["error"],
            e["baseline_error"],
            False,
            f"{party}'s rows (in-sample)",
        )
        for party, e in errors.items()
    ]
    held_out = sum(s["rows"] for s in holdout or [])
    if held_out:
        positive = sum(s["positives"] for s in holdout) / held_out
        quality.append(
            Quality(
                "held-out misclassification",
                sum(s["errors"] for s in holdout) / held_out,
                min(positive, 1.0 - positive),
                False,
                f"{held_out} held-out rows of all parties",
            )
        )
    budgets = [
        BudgetLine.from_status(party, r["budget"])
        for party, r in releases.items()
        if r.get("budget") is not None
    ]
    kept = f"{len(model['support'])} of {len(model['features'])}"
    return publish_summary(
        RunSummary(
            job.job_id,
            {party: e["rows"] for party, e in errors.items()},
            quality=quality,
            budgets=budgets,
            bytes_sent=bytes_sent([job.job_id], workspace),
            rounds=1,
            details=[sparse_lda_fit(job), ("features the model uses (support)", kept)],
        )
    ) | {"curves": {f"{party}'s rows (in-sample)": e["roc"] for party, e in errors.items()}}


#: A party-unit sparse LDA's ``method`` in plain words.
_SPARSE_LDA_METHODS = {
    "debiased": "each party's own fit, debiased, then averaged",
    "naive": "each party's own fit averaged as it is",
    "centralized_reference": "one fit on rows pooled at the coordinator (not private)",
}


def sparse_lda_fit(job: Any) -> tuple[str, str]:
    """How a sparse LDA model was fitted, as a summary line: plain words, the parameter in
    brackets (``method`` means something only when a release protects a whole party)."""
    if job.row_unit:
        return (
            "how the model was fitted (privacy unit row)",
            "one fit on noisy statistics summed over every party's rows",
        )
    label = f"how the model was fitted (method {job.method})"
    return label, _SPARSE_LDA_METHODS.get(job.method, job.method)
