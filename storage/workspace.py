"""Where a deployment keeps its run folders (the channel) by default.

Party databases live wherever their descriptors say; the workspace holds what belongs to a
run rather than to a party: the messages that crossed, and nothing secret.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from storage.channel import Channel

DEFAULT_ROOT = "var"


def workspace_root(root: str | None = None) -> Path:
    return Path(root or os.environ.get("PRIVREG_HOME", DEFAULT_ROOT))


def channel_for(job_id: str, root: str | None = None) -> Channel:
    return Channel(workspace_root(root), job_id)


def derive_job_id(protocol: str, inputs: dict[str, Any]) -> str:
    """A stable job id from a protocol name and its (JSON-able) inputs.

    Runs with the same inputs share a job id, so they resume and reuse each other's state;
    any change of input starts a fresh job.
    """
    text = json.dumps(inputs, sort_keys=True, default=str)
    return f"{protocol}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
