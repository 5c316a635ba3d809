"""One process that serves every flow with its schedule: no work pool, no worker.

``make serve`` runs this against the server in ``PREFECT_API_URL`` (start one with ``make ui``).
The nightly schedule is active for the pipeline only; the other flows are served for
on-demand runs from the UI with the demo job's parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import serve

from flows.align import psi_align
from flows.pipeline import pipeline
from flows.vertical_lr import vertical_lr

ROOT = Path(__file__).resolve().parents[1]


def _demo_tables() -> tuple[dict, dict]:
    job = json.loads((ROOT / "jobs" / "demo.json").read_text())
    return job["parties"]["guest"]["table"], job["parties"]["host"]["table"]


def main() -> None:
    guest, host = _demo_tables()
    aligned_guest = {**guest, "table": f"{guest['table']}_aligned"}
    aligned_host = {**host, "table": f"{host['table']}_aligned"}
    serve(
        pipeline.to_deployment(
            name="demo-pipeline", cron="0 2 * * *", parameters={"job_file": "jobs/demo.json"}
        ),
        psi_align.to_deployment(name="demo-psi", parameters={"party_a": guest, "party_b": host}),
        vertical_lr.to_deployment(
            name="demo-vertical", parameters={"guest": aligned_guest, "hosts": [aligned_host]}
        ),
    )


if __name__ == "__main__":
    main()
