"""Helpers shared by the flow tests."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from core.paillier.keys import SMALL_KEYS_VARIABLE
from federation.channel import FileTransport, MessageKey
from storage.artifacts import ArtifactStore
from storage.descriptor import TableRef
from storage.party_store import PartyStore

ROOT = Path(__file__).resolve().parents[1]


def arrays_in(value: Any) -> list[np.ndarray]:
    """Every numpy array inside a decoded message."""
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays_in(v)]
    if isinstance(value, list):
        return [a for v in value for a in arrays_in(v)]
    return []


def summary_quality(key: str) -> dict[str, tuple[float | None, float | None, str]]:
    """The quality table of a published summary, read back through the Prefect API:
    metric -> (model, baseline, rows)."""
    from prefect.artifacts import Artifact

    artifact = Artifact.get(key)
    assert artifact is not None, f"no artifact {key}"
    section = artifact.data.split("## Quality", 1)[1].split("##", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.strip().splitlines()[2:]]
    number = lambda text: float(text) if text.strip() else None  # noqa: E731
    return {r[0].strip(): (number(r[1]), number(r[2]), r[3].strip()) for r in rows}


def relocate_job(job: dict[str, Any], root: Path, workspace: Path) -> Path:
    """Copy a job's source files into ``workspace``, point its databases there, write it out.

    Flow tests run the bundled demo jobs without touching the repository's ``var/`` folder.
    """
    for party in job["parties"].values():
        name = Path(party["source"]).name
        shutil.copy(root / party["source"], workspace / name)
        party["source"] = str(workspace / name)
        party["table"]["database"] = str(workspace / Path(party["table"]["database"]).name)
    job_file = workspace / "job.json"
    job_file.write_text(json.dumps(job))
    return job_file


def vertical_slices(job_id: str, *descriptors: dict) -> dict[str, list[float]]:
    """Every party's stored model slice of a vertical job, read from its own store."""
    slices = {}
    for descriptor in descriptors:
        ref = TableRef.from_dict(descriptor)
        model = ArtifactStore(PartyStore.of(ref)).get(f"models/vertical/{job_id}/{ref.party}")
        head = [] if model["intercept"] is None else [model["intercept"]]  # the guest's
        slices[ref.party] = [float(w) for w in (*head, *model["coefficients"].values())]
    return slices


def party_env(folder: Path, small_keys: bool = True) -> dict[str, str]:
    """A party process's environment: no PRIVREG_* settings of this process, its own
    Prefect home under ``folder``, the test server's API, and (``small_keys``) the party's own
    opt-in to keys below 2048 bits."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIVREG_")}
    if small_keys:
        env[SMALL_KEYS_VARIABLE] = "1"
    env.update(
        PYTHONPATH=str(ROOT),
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
        PREFECT_HOME=str(folder / "prefect"),
        GRPC_VERBOSITY="NONE",
    )
    return env


_TIMING_FIELD = re.compile(r'"\w*(?:time|duration|seconds)\w*"\s*:\s*-?\d+(?:\.\d+)?(?:e-?\d+)?')
"""A JSON field Prefect stores about timing (``"total_run_time": 0.089834``): its number is a
duration, which can coincide with a six-digit feature value, so it is not scanned."""


def found_in(folder: Path, values: set[str]) -> set[str]:
    """Which of ``values`` appear, as whole numbers, in any file under ``folder`` (outside
    Prefect's timing fields)."""
    text = "\n".join(f.read_bytes().decode("latin-1") for f in folder.rglob("*") if f.is_file())
    text = _TIMING_FIELD.sub("", text)
    numbers = set(re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.])", text))
    return values & numbers


def chart_images(markdown: str) -> list[str]:
    """The SVG documents a charts artifact embeds as ``data:`` images, in order."""
    encoded = re.findall(r"\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", markdown)
    return [base64.b64decode(e).decode("utf-8") for e in encoded]


class FetchLog(FileTransport):
    """One party's own transport over a shared folder: it notes the kind of every message it
    is asked for, and background fetches run as they do over the network (a shared folder's
    transport has no party, and then nothing is fetched ahead)."""

    def __init__(self, root: Path, party: str) -> None:
        super().__init__(root)
        self.party = party
        self.asked: list[str] = []

    def get(self, key: MessageKey, timeout: float) -> bytes:
        self.asked.append(key.kind)
        return super().get(key, timeout)
