"""Flow ``pipeline``: the main job, from the parties' source files to trained models.

    load each party's table ──▶ PSI alignment ──▶ vertical LR ──▶ sub-jobs ──▶ summary

Sub-jobs (label DP, horizontal LR, sparse LDA) have parties of their own and run from
their own job files, named in this job file's ``subjobs``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags

from core.preprocessing import PreprocessingSpec
from flows.align import psi_align
from flows.horizontal_lr import horizontal_job
from flows.jobs import load_job_tree, read_job
from flows.label_dp import label_dp_job
from flows.sparse_lda import sparse_lda_job
from flows.sparse_lda import summary_line as sparse_lda_summary
from flows.vertical_lr import vertical_lr
from flows.walr import walr
from storage.descriptor import TableRef
from storage.models import model_key
from storage.workspace import channel_for
from tasks.loading import load_table
from tasks.reporting import run_namer
from tasks.scoring import promote_model
from tasks.summaries import pipeline_summary

Stage = tuple[str, str]  # (one-line result, job id whose channel holds the stage's messages)


def _label_dp_stage(job_file: str, workspace: str | None) -> Stage:
    result = label_dp_job(job_file, workspace)
    mechanism, budget = result["mechanism"], result["budget"]
    test = result["metrics"].get("test_mse")
    summary = (
        f"{mechanism['mechanism']} eps {mechanism['epsilon']:g}, {mechanism['bins']} bins, "
        f"privacy spent {budget['epsilon_spent']:g} of {budget['epsilon_total']:g}"
        + (f", test MSE {test:.0f}" if test is not None else "")
        + (" (release reused)" if result["reused"] else "")
    )
    return summary, result["job_id"]


def _horizontal_stage(job_file: str, workspace: str | None) -> Stage:
    result = horizontal_job(job_file, workspace)
    summary = (
        f"{result['rounds_completed']} rounds ({result['rounds_run']} run now), "
        f"loss {result['history'][-1]['loss']:.4f}"
    )
    return summary, result["job_id"]


def _sparse_lda_stage(job_file: str, workspace: str | None) -> Stage:
    result = sparse_lda_job(job_file, workspace)
    return sparse_lda_summary(result), result["job_id"]


SUBJOBS: dict[str, Callable[[str, str | None], Stage]] = {
    "label_dp": _label_dp_stage,
    "horizontal_lr": _horizontal_stage,
    "sparse_lda": _sparse_lda_stage,
}


def _bytes_exchanged(job_id: str, workspace: str | None) -> str:
    """Bytes each party sent in the stage's job (all runs of it), from the channel's log."""
    sent = channel_for(job_id, workspace).bytes_by_party()
    return ", ".join(f"{party} {totals['sent'] / 1024:,.0f} KiB" for party, totals in sent.items())


def _summary_markdown(job: str, stages: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"# privreg pipeline: {job}",
        "",
        "| stage | seconds | result | bytes sent per party |",
        "|---|---|---|---|",
    ]
    for name, stage in stages.items():
        lines.append(
            f"| {name} | {stage['seconds']:.1f} | {stage['result']} | {stage.get('bytes', '')} |"
        )
    return "\n".join(lines)


class _Timer:
    """Records one stage's seconds, result and traffic into ``stages``."""

    def __init__(self, stages: dict[str, dict[str, Any]], name: str, workspace: str | None):
        self.stages, self.name, self.workspace = stages, name, workspace
        self.started = time.perf_counter()

    def done(self, result: str, job_id: str | None = None) -> None:
        stage = {"seconds": time.perf_counter() - self.started, "result": result}
        if job_id is not None:
            stage["bytes"] = _bytes_exchanged(job_id, self.workspace)
            stage["job_id"] = job_id
        self.stages[self.name] = stage
        get_run_logger().info(
            "progress: %s done in %.1f s: %s", self.name, stage["seconds"], result
        )


@flow(name="pipeline", flow_run_name=run_namer("pipeline"))
def pipeline(job_file: str = "jobs/demo.json", workspace: str | None = None) -> dict[str, Any]:
    """Run every stage the job file configures; prints and records a summary.

    Args:
        job_file: Path of the job file (JSON) naming the parties, their sources and stages.
        workspace: Folder for the runs' messages (default: var or PRIVREG_HOME).
    """
    load_job_tree(job_file)  # the job and its sub-jobs, validated before anything is loaded
    job = read_job(job_file, "main")
    name = job.get("job") or Path(job_file).stem
    with tags(f"job:{name}"):  # names the stages' runs
        return _stages(job, job_file, workspace, name)


#: The model flow of each sub-job, as model keys name it (``storage.models``).
SUBJOB_MODELS = {"label_dp": "label_dp", "horizontal_lr": "horizontal", "sparse_lda": "sparse_lda"}


def _promote(refs: list[TableRef], flow: str, job_id: str, job: str, share: bool = False) -> None:
    """What the pipeline trained becomes the model its job's scoring uses, at each party that
    holds it (each share of a split model at its own party)."""
    for ref in refs:
        promote_model(ref, model_key(flow, job_id, ref.party if share else None), job)


def _stages(job: dict[str, Any], job_file: str, workspace: str | None, name: str) -> dict[str, Any]:
    stages: dict[str, dict[str, Any]] = {}

    timer = _Timer(stages, "load", workspace)
    refs = {role: TableRef.from_dict(party["table"]) for role, party in job["parties"].items()}
    spec = PreprocessingSpec.from_dict(job.get("preprocessing"))  # the job's, every table
    for role, party in job["parties"].items():  # a privacy_budget applies only if none is set
        own = spec.with_party(party.get("preprocessing"))  # its missing values, categories
        load_table(party["source"], refs[role], party.get("privacy_budget"), own.to_dict())
    timer.done(", ".join(f"{r.party}.{r.table}" for r in refs.values()))

    timer = _Timer(stages, "psi", workspace)
    alignment = psi_align(
        refs["guest"].to_dict(),
        refs["host"].to_dict(),
        min_rows=job.get("psi", {}).get("min_rows", 100),
        workspace=workspace,
        **({"protocol": job["psi"]["protocol"]} if "protocol" in job.get("psi", {}) else {}),
    )
    sizes = alignment["set_sizes"]
    timer.done(
        f"{alignment['intersection_size']} shared rows of {sizes[0]} / {sizes[1]}"
        + (" (reused)" if alignment["reused"] else ""),
        alignment["job_id"],
    )
    aligned = [TableRef.from_dict(d) for d in alignment["aligned"]]

    model = None
    if "vertical" in job:
        timer = _Timer(stages, "vertical_lr", workspace)
        model = vertical_lr(
            aligned[0].to_dict(),
            [aligned[1].to_dict()],
            workspace=workspace,
            preprocessing=spec.to_dict(),
            **job["vertical"],
        )
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in model["metrics"].items() if "auc" in k)
        timer.done(f"{model['rounds_run']} rounds run, {metrics}", model["job_id"])
        _promote(aligned, "vertical", model["job_id"], name, share=True)

    if "walr" in job:  # the host's features, the guest's labels (its own features unused)
        timer = _Timer(stages, "walr", workspace)
        release = walr(  # charged by the label owner to its source table
            aligned[1].to_dict(),
            aligned[0].to_dict(),
            workspace=workspace,
            preprocessing=spec.to_dict(),
            **job["walr"],
        )
        auc = release["metrics"].get("auc")
        timer.done(
            f"eps {release['epsilon']:g}, sigma {release['sigma']:.2f}, privacy left "
            f"{release['budget']['epsilon_left']:g}"
            + (f", auc {auc:.4f}" if auc is not None else "")
            + (" (release reused)" if release["reused_release"] else ""),
            release["job_id"],
        )
        promote_model(aligned[1], release["model_key"], name)  # the features party's

    for stage, sub_job in job.get("subjobs", {}).items():
        timer = _Timer(stages, stage, workspace)
        result, job_id = SUBJOBS[stage](sub_job, workspace)
        timer.done(result, job_id)
        holders = [TableRef.from_dict(p["table"]) for p in read_job(sub_job)["parties"].values()]
        _promote(holders, SUBJOB_MODELS[stage], job_id, name)

    summary = _summary_markdown(job.get("job", job_file), stages)
    pipeline_summary(stages, alignment, [s.get("job_id") for s in stages.values()], workspace)
    print(summary)
    return {"stages": stages, "alignment": alignment, "vertical": model}


if __name__ == "__main__":
    pipeline(*sys.argv[1:2])
