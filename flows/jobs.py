"""Job files: the small JSON documents that hold a deployment's parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_job(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"job file {path} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"job file {path} is not valid JSON: {error}") from None
