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

from federation.channel import Channel
from federation.party_config import active_config
from storage.party_store import owner_only_umask

DEFAULT_ROOT = "var"


def workspace_root(root: str | None = None) -> Path:
    return Path(root or os.environ.get("PRIVREG_HOME", DEFAULT_ROOT))


def channel_for(job_id: str, root: str | None = None) -> Channel:
    """The job's channel for the party this code runs as.

    A side of a local run (:meth:`PartyConfig.local_party`): the run's shared folder. A party
    at its own organisation: the party's own folder and the mTLS network transport. Either
    way ``root`` is ignored, since a party knows no folder but its own. No party (a helper
    that reads a run's log): the folder ``root``.
    """
    owner_only_umask()  # the message files and folders are private from their creation
    config = active_config()
    if config is None:
        return Channel(workspace_root(root), job_id)
    if config.local:
        return Channel(config.root, job_id, timeout=config.receive_timeout)
    from federation.transport_grpc import transport_for

    return Channel(config.root, job_id, transport_for(config), timeout=config.receive_timeout)


def derive_job_id(protocol: str, inputs: dict[str, Any]) -> str:
    """A stable job id from a protocol name and its (JSON-able) inputs.

    Runs with the same inputs share a job id, so they resume and reuse each other's state;
    any change of input starts a fresh job.
    """
    text = json.dumps(inputs, sort_keys=True, default=str)
    return f"{protocol}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
