"""Flow ``pipeline``: the main job, from the parties' source files to trained models.

load each party's table ──▶ PSI alignment ──▶ (training stages) ──▶ summary
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.align import psi_align
from flows.horizontal_lr import horizontal_job
from flows.jobs import read_job
from flows.label_dp import label_dp_job
from flows.vertical_lr import vertical_lr
from storage.descriptor import TableRef
from tasks.loading import load_table


def _label_dp_stage(job_file: str, workspace: str | None) -> str:
    result = label_dp_job(job_file, workspace)
    mechanism, budget = result["mechanism"], result["budget"]
    test = result["metrics"].get("test_mse")
    return (
        f"{mechanism['mechanism']} eps {mechanism['epsilon']:g}, {mechanism['bins']} bins, "
        f"spent {budget['epsilon_spent']:g} of {budget['epsilon_total']:g}"
        + (f", test MSE {test:.0f}" if test is not None else "")
        + (" (release reused)" if result["reused"] else "")
    )


def _horizontal_stage(job_file: str, workspace: str | None) -> str:
    result = horizontal_job(job_file, workspace)
    return (
        f"{result['rounds_completed']} rounds ({result['rounds_run']} run now), "
        f"loss {result['history'][-1]['loss']:.4f}"
    )


SUBJOBS: dict[str, Callable[[str, str | None], str]] = {
    "label_dp": _label_dp_stage,
    "horizontal_lr": _horizontal_stage,
}


def _summary_markdown(job: str, stages: dict[str, dict[str, Any]]) -> str:
    lines = [f"# privreg pipeline: {job}", "", "| stage | seconds | result |", "|---|---|---|"]
    for name, stage in stages.items():
        lines.append(f"| {name} | {stage['seconds']:.1f} | {stage['result']} |")
    return "\n".join(lines)


@flow(name="pipeline", flow_run_name="pipeline {job_file}")
def pipeline(job_file: str = "jobs/demo.json", workspace: str | None = None) -> dict[str, Any]:
    """Run every stage the job file configures; prints and records a summary."""
    job = read_job(job_file)
    stages: dict[str, dict[str, Any]] = {}

    started = time.perf_counter()
    refs = {}
    for role, party in job["parties"].items():
        refs[role] = TableRef.from_dict(party["table"])
        load_table(party["source"], refs[role])
    stages["load"] = {
        "seconds": time.perf_counter() - started,
        "result": ", ".join(f"{r.party}.{r.table}" for r in refs.values()),
    }

    started = time.perf_counter()
    alignment = psi_align(
        refs["guest"].to_dict(),
        refs["host"].to_dict(),
        min_rows=job.get("psi", {}).get("min_rows", 100),
        workspace=workspace,
    )
    stages["psi"] = {
        "seconds": time.perf_counter() - started,
        "result": f"{alignment['intersection_size']} shared rows of "
        f"{alignment['set_sizes'][0]} / {alignment['set_sizes'][1]}"
        + (" (reused)" if alignment["reused"] else ""),
    }

    aligned = {
        role: TableRef.from_dict(d)
        for role, d in zip(("guest", "host"), alignment["aligned"], strict=True)
    }
    if "vertical" in job:
        started = time.perf_counter()
        model = vertical_lr(
            aligned["guest"].to_dict(),
            [aligned["host"].to_dict()],
            workspace=workspace,
            **job["vertical"],
        )
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in model["metrics"].items() if "auc" in k)
        stages["vertical_lr"] = {
            "seconds": time.perf_counter() - started,
            "result": f"{model['rounds_run']} rounds, {metrics}",
        }

    for name, sub_job in job.get("subjobs", {}).items():
        started = time.perf_counter()
        stages[name] = {"result": SUBJOBS[name](sub_job, workspace)}
        stages[name]["seconds"] = time.perf_counter() - started

    summary = _summary_markdown(job.get("job", job_file), stages)
    create_markdown_artifact(summary, key="pipeline-summary", description="privreg pipeline")
    print(summary)
    return {"stages": stages, "alignment": alignment}


if __name__ == "__main__":
    pipeline()
