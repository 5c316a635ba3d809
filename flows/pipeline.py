"""Flow ``pipeline``: the main job run locally, every organisation's side in this process.

More: docs/federation.md (how the parties run a job, and why).
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow

from core.job_files import load_job_tree, read_job
from core.job_schema import job_kind
from federation.workspace import derive_job_id
from flows.local_run import LocalJob, LocalSide, run_locally
from flows.pipeline_party import PipelineResult, organisations, pipeline_party
from tasks.reporting import RunSummary, bytes_sent, markdown_table, publish_summary, run_namer


def _bytes_sent(job_id: str, workspace: str | None) -> str:
    """What each party sent in a stage's job (all runs of it), from the channel's log."""
    sent = bytes_sent([job_id], workspace)
    return ", ".join(f"{party} {count / 1024:,.1f} KiB" for party, count in sent.items())


def summary_markdown(name: str, results: dict[str, PipelineResult], workspace: str | None) -> str:
    """One row per party and stage, in the order the stages ran, and each stage's traffic."""
    rows = [
        {
            "party": party,
            "stage": f"{stage.job}/{stage.stage}",
            "role": stage.role,
            "seconds": f"{stage.seconds:.1f}",
            "result": stage.summary,
        }
        for party, result in sorted(results.items())
        for stage in result.stages
    ]
    job_ids = dict.fromkeys(
        s.job_id for _, r in sorted(results.items()) for s in r.stages if s.stage != "load"
    )
    traffic = [
        {"stage's job": job_id, "bytes sent per party": _bytes_sent(job_id, workspace)}
        for job_id in job_ids
    ]
    return "\n".join(
        [f"# privreg pipeline: {name}", "", markdown_table(rows), "", markdown_table(traffic)]
    )


@flow(name="pipeline", flow_run_name=run_namer("pipeline"))
def pipeline(
    job_file: str = "jobs/demo.json", workspace: str | None = None, run: str = ""
) -> dict[str, PipelineResult]:
    """Run every stage the job file configures (a main job and its sub-jobs, or a sub-job
    file on its own), each party's side locally; returns each party's result (what that party
    may see) and records a summary.

    Args:
        job_file: Path of the job file (JSON) naming the parties, their sources and stages;
            its relative paths are read from the current folder.
        workspace: Folder for the runs' messages and the key holders' stores (default: var or
            PRIVREG_HOME).
        run: Suffix of every job id for a re-run ("" for the job itself).
    """
    spec = read_job(job_file)  # a main job and its sub-jobs, or one sub-job file alone
    if job_kind(spec) == "main":
        load_job_tree(job_file)  # every sub-job validated too, before anything is loaded
    parties = organisations(job_file, Path.cwd())
    sides = [LocalSide(party, lambda: pipeline_party(job_file, run)) for party in sorted(parties)]
    results = run_locally(LocalJob(sides, workspace))
    name = (spec.get("job") or Path(job_file).stem) + (f"-{run}" if run else "")
    publish_summary(_run_summary(name, results, workspace))
    print(summary_markdown(name, results, workspace))
    return results


def _run_summary(
    name: str, results: dict[str, PipelineResult], workspace: str | None
) -> RunSummary:
    """The run's one summary, as every flow publishes it: each party's rows, the bytes each
    sent over every stage, and each party's stage lines."""
    rows: dict[str, int] = {}
    job_ids: dict[str, None] = {}
    details = []
    for party, result in sorted(results.items()):
        for stage in result.stages:
            if stage.stage == "load":
                rows[party] = rows.get(party, 0) + sum(stage.result.get("rows", {}).values())
            else:
                job_ids[stage.job_id] = None
            details.append((f"{party} {stage.job}/{stage.stage}", stage.summary))
    run_id = derive_job_id("pipeline", {"job": name, "stages": list(job_ids)})
    return RunSummary(run_id, rows, bytes_sent=bytes_sent(job_ids, workspace), details=details)


if __name__ == "__main__":
    pipeline(*sys.argv[1:2])
