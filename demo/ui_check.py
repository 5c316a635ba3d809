"""``make ui-check``: do the training charts show in the Prefect UI? A look, not a test.

Starts a local Prefect server (or reuses the one at ``UI_CHECK_URL``), trains horizontal LR on
the demo's three hospitals with a hold-out in this process against it, checks through the API
that the run's charts artifact is there and holds its images, then has headless Chromium (the
distribution's package) screenshot the artifact in both UIs into ``var/ui-check/``. Fails when
the artifact, an image or a screenshot is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "var" / "ui-check"
URL = os.environ.get("UI_CHECK_URL", "http://127.0.0.1:4200").rstrip("/")
os.environ["PREFECT_API_URL"] = f"{URL}/api"  # before Prefect is imported: runs go there
sys.path.insert(0, str(ROOT))

HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
#: A screenshot under this many bytes is a blank or half-drawn page.
MIN_SCREENSHOT_BYTES = 60_000


class UICheckError(RuntimeError):
    """What ``make ui-check`` could not see."""


def _api(path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{URL}/api{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _healthy() -> bool:
    try:
        return _api("/health") is True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_server() -> subprocess.Popen | None:
    """A Prefect server of its own (state under var/ui-check/prefect), unless one answers."""
    if _healthy():
        print(f"reusing the Prefect server at {URL}")
        return None
    host, _, port = URL.removeprefix("http://").partition(":")
    env = {**os.environ, "PREFECT_HOME": str(OUT / "prefect"), "PREFECT_UI_API_URL": f"{URL}/api"}
    env.pop("PREFECT_API_URL")  # (the UI would otherwise call the default port's API)
    log = (OUT / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", port],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    while not _healthy():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise UICheckError(f"the Prefect server did not start: see {OUT / 'server.log'}")
        time.sleep(1)
    print(f"started a Prefect server at {URL} (pid {server.pid})")
    return server


def train() -> str:
    """Horizontal LR on the demo hospitals, 20% held out; returns the flow run's id."""
    import pandas as pd
    from prefect import tags

    from flows.horizontal_lr import horizontal_lr
    from storage.descriptor import TableRef
    from storage.party_store import PartyStore

    work = OUT / "work"
    shutil.rmtree(work, ignore_errors=True)
    refs = []
    for name in HOSPITALS:
        (work / name).mkdir(parents=True)
        ref = TableRef(
            database=str(work / name / f"{name}.duckdb"),
            table="patients",
            party=name,
            id_column="patient_id",
            label_column="diagnosis",
            label_domain=(0, 1),
        )
        PartyStore.of(ref).write_table(
            ref.table, pd.read_csv(ROOT / "demo/horizontal" / f"{name}.csv")
        )
        refs.append(ref.to_dict())
    with tags("job:ui-check"):
        state = horizontal_lr(
            refs, rounds=12, learning_rate=0.5, holdout_fraction=0.2, workspace=str(work),
            return_state=True,
        )  # fmt: skip
    if not state.is_completed():
        raise UICheckError(f"the training run ended {state.name}: {state.message}")
    return str(state.state_details.flow_run_id)


def charts_artifact(run_id: str) -> dict[str, Any]:
    """The run's charts artifact, read back through the API, with its images counted."""
    found = _api("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
    charts = [a for a in found if (a.get("key") or "").endswith("-charts")]
    if not charts:
        kinds = sorted(f"{a.get('key')} ({a['type']})" for a in found)
        raise UICheckError(f"flow run {run_id} has no charts artifact, only {kinds}")
    artifact = charts[0]
    images = str(artifact["data"]).count("](data:image/svg+xml;base64,")
    if artifact["type"] != "markdown" or images < 2:
        raise UICheckError(f"{artifact['key']}: {artifact['type']} with {images} images")
    return {**artifact, "images": images}


def _chromium(browser: str, url: str, *options: str) -> str:
    """Headless Chromium on one UI page (a fresh profile: no saved UI choice); its stdout."""
    with tempfile.TemporaryDirectory() as profile:
        command = [
            browser, "--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={profile}", "--virtual-time-budget=25000", *options, url,
        ]  # fmt: skip
        if os.geteuid() == 0:
            command.insert(1, "--no-sandbox")  # Chromium refuses to sandbox as root
        done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=180)
    return done.stdout


def screenshot(browser: str, url: str, path: Path, height: int, images: int) -> int:
    """The page's picture; with ``images``, the rendered page must show that many charts
    (``<img>`` elements with an SVG ``data:`` source in its DOM)."""
    if images:
        shown = _chromium(browser, url, "--dump-dom").count('src="data:image/svg+xml;base64,')
        if shown < images:
            raise UICheckError(f"{url} shows {shown} of the artifact's {images} charts")
    path.unlink(missing_ok=True)
    _chromium(browser, url, f"--window-size=1400,{height}", f"--screenshot={path}")
    size = path.stat().st_size if path.exists() else 0
    if size < MIN_SCREENSHOT_BYTES:
        raise UICheckError(f"{path} is {size} bytes: the page did not render ({url})")
    return size


def main() -> int:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("make ui-check needs Chromium, from the distribution: apt-get install chromium")
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    server = start_server()
    try:
        run_id = train()
        artifact = charts_artifact(run_id)
        charts = artifact["images"]
        pages = {  # the React UI (the default) under /v2, the Vue UI under /
            "v2-artifact.png": (f"{URL}/v2/artifacts/artifact/{artifact['id']}", 2200, charts),
            "v2-flow-run-artifacts.png": (
                f"{URL}/v2/runs/flow-run/{run_id}?tab=Artifacts",
                1200,
                0,
            ),
            "v1-artifact.png": (f"{URL}/artifacts/artifact/{artifact['id']}", 2200, charts),
        }
        rows = [
            (name, screenshot(browser, url, OUT / name, height, images), url)
            for name, (url, height, images) in pages.items()
        ]
    except UICheckError as error:
        print(f"ui-check failed: {error}")
        return 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    print(f"\nartifact `{artifact['key']}` ({artifact['type']}, {artifact['images']} SVG images)")
    print(f"of flow run {run_id}\n\n| screenshot | bytes | page |\n|---|---|---|")
    for name, size, url in rows:
        print(f"| var/ui-check/{name} | {size} | {url} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
