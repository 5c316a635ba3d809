"""One process that serves every flow of ``prefect.yaml``: no work pool, no worker.

``make serve`` runs this against the server in ``PREFECT_API_URL`` (start one with ``make
ui``). Deployments, parameters and schedules are read from ``prefect.yaml``, so the two ways of
running privreg never drift apart; only active schedules are served as schedules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prefect import serve
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parents[1]


def served_deployments(spec: dict[str, Any]) -> list[Any]:
    deployments = []
    for entry in spec["deployments"]:
        flow = load_flow_from_entrypoint(str(ROOT / entry["entrypoint"]))
        crons = [s["cron"] for s in entry.get("schedules", []) if s.get("active", True)]
        deployments.append(
            flow.to_deployment(
                name=entry["name"],
                description=entry.get("description"),
                parameters=entry.get("parameters", {}),
                cron=crons[0] if crons else None,
            )
        )
    return deployments


def main() -> None:
    serve(*served_deployments(yaml.safe_load((ROOT / "prefect.yaml").read_text())))


if __name__ == "__main__":
    main()
