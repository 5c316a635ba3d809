"""What the Prefect UI shows: per-round tables, progress, summaries, links to saved models.

Artifact keys are stable per flow and job (lowercase letters, digits and dashes), so the UI's
Artifacts page shows their history run over run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)


def artifact_key(*parts: str) -> str:
    key = "-".join(parts).lower()
    return re.sub(r"[^a-z0-9-]+", "-", key).strip("-")[:100]


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return round(value, 6)
    return value


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    create_table_artifact(
        key=key,
        table=[{k: _plain(v) for k, v in row.items()} for row in rows],
        description=description,
    )


def publish_markdown(key: str, markdown: str, description: str) -> None:
    create_markdown_artifact(key=key, markdown=markdown, description=description)


def publish_model_link(key: str, database: str | Path, model_key: str) -> None:
    path = Path(database).resolve()
    create_link_artifact(
        key=key,
        link=path.as_uri(),
        link_text=f"{model_key} in {path.name}",
        description=f"saved model `{model_key}` in the party database",
    )


class Progress:
    """A progress artifact for a flow's rounds (0-100%)."""

    def __init__(self, total: int, description: str) -> None:
        self.total = max(total, 1)
        self.id = create_progress_artifact(progress=0.0, description=description)

    def update(self, done: int) -> None:
        if self.id is not None:
            update_progress_artifact(self.id, progress=min(100.0, 100.0 * done / self.total))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(_plain(row[h])) for h in header) + " |" for row in rows]
    return "\n".join(lines)
