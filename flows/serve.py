"""One process that serves every flow of ``prefect.yaml`` from this checkout: no pool, no worker.

More: docs/federation.md (how the parties run a job, and why).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from prefect import serve
from prefect.flows import load_flow_from_entrypoint
from prefect.schedules import Cron

ROOT = Path(__file__).resolve().parents[1]
SERVED_SUFFIX = "-served"


def worker_deployments() -> set[str]:
    """Names of the deployments this server runs on a work pool (``make deploy``)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {d.name for d in client.read_deployments() if d.work_pool_name}


def served_deployments(spec: dict[str, Any], deployed: set[str] | None = None) -> list[Any]:
    """The served twins of ``prefect.yaml``'s deployments; those already ``deployed`` to a
    worker keep their schedules there, so theirs are served inactive."""
    deployments = []
    for entry in spec["deployments"]:
        flow = load_flow_from_entrypoint(str(ROOT / entry["entrypoint"]))
        scheduled_here = entry["name"] not in (deployed or set())
        schedules = [
            Cron(
                s["cron"],
                timezone=s.get("timezone"),
                active=scheduled_here and s.get("active", True),
            )
            for s in entry.get("schedules", [])
        ]
        deployments.append(
            flow.to_deployment(
                name=entry["name"] + SERVED_SUFFIX,
                description=entry.get("description"),
                parameters=entry.get("parameters", {}),
                tags=entry.get("tags"),
                schedules=schedules or None,
            )
        )
    return deployments


def main() -> None:
    os.chdir(ROOT)  # the flows' relative paths (var/parties/...) are the checkout's
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    serve(*served_deployments(spec, worker_deployments()))


if __name__ == "__main__":
    main()
