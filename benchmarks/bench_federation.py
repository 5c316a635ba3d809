"""How fast a job's failures reach every organisation (``make bench-federation``).

Three organisations as their own processes over mTLS on loopback (the clinic as guest, the lab
as host, the arbiter), each with its own temporary Prefect, run the demo's main job (PSI, one
vertical epoch, 1024-bit keys). Measured, median of ``--repeats`` runs:

* failure to every peer: the clinic fails at set-up (its source lacks the label column); the
  time from its exit to the last peer's exit (target: under 10 s);
* kill -9 to "down": the lab's side is killed while its Paillier pool works; the time until
  the clinic and the arbiter report it down in their logs (the job's ``down_after``, 30 s,
  plus at most one poll), and until every process the lab's side started is gone.

Rounds with a dropped hospital against none: ``make bench-horizontal``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.lifetime import descendants
from demo.orgs import Org, serve_all, start
from demo.parties import prepare, small_main_job

ROOT = Path(__file__).resolve().parents[1]
PATIENCE = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}


def sides(orgs: dict[str, Org], run: str, logs: Path) -> dict[str, subprocess.Popen]:
    args = ["--job-file", "jobs/demo.json", "--run", run]
    started = {}
    for party, org in orgs.items():
        with (logs / f"{party}-{run}.log").open("w") as log:
            started[party] = start(org, "pipeline", args, PATIENCE, stderr=log)
    return started


def failure_to_every_peer(orgs: dict[str, Org], run: str, logs: Path) -> float:
    clinic = orgs["clinic"].folder / "demo/clinic_guest.csv"
    good = clinic.read_bytes()
    clinic.write_text("patient_id,x1\np1,0.5\n")
    try:
        running = sides(orgs, run, logs)
        ended: dict[str, float] = {}
        while len(ended) < len(running):
            for party, process in running.items():
                if party not in ended and process.poll() is not None:
                    ended[party] = time.monotonic()
            time.sleep(0.05)
    finally:
        clinic.write_bytes(good)
    return max(ended.values()) - ended["clinic"]


def kill_to_down(orgs: dict[str, Org], run: str, logs: Path) -> tuple[float, float]:
    running = sides(orgs, run, logs)
    lab = running["lab"]
    try:
        state = orgs["lab"].folder / "home" / "runs" / f"demo-{run}" / "status" / "lab"
        # its side is in vertical LR (its temporary Prefect server is a child from the start)
        while "demo-vertical" not in (state.read_text() if state.exists() else ""):
            if lab.poll() is not None:
                raise RuntimeError("the lab's side ended before vertical LR")
            time.sleep(0.1)
        family = descendants(lab.pid)
        lab.kill()
        killed = time.monotonic()
        gone = down = None
        while gone is None or down is None:
            now = time.monotonic()
            if gone is None and not any(Path(f"/proc/{pid}").exists() for pid in family):
                gone = now - killed
            reports = [
                (logs / f"{p}-{run}.log").read_text().count("party lab is down")
                for p in ("clinic", "arbiter")
            ]
            if down is None and all(reports):
                down = now - killed
            if now - killed > 180:
                raise TimeoutError("no down report within 180 s")
            time.sleep(0.1)
        return down, gone
    finally:
        for process in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="privreg-bench-federation-") as folder:
        root = Path(folder)
        small_main_job(root / "source")
        orgs = prepare(root / "orgs", source=root / "source", receive_timeout=300)
        logs = root / "logs"
        logs.mkdir()
        servers = serve_all(orgs.values())
        try:
            failures = [failure_to_every_peer(orgs, f"f{i}", logs) for i in range(args.repeats)]
            kills = [kill_to_down(orgs, f"k{i}", logs) for i in range(args.repeats)]
        finally:
            for server in servers:
                server.terminate()
            for server in servers:
                server.wait(timeout=60)
    rows = [
        ("failure at set-up -> last peer's exit", statistics.median(failures), "< 10 s"),
        ("kill -9 -> down reported by both peers", statistics.median(k[0] for k in kills),
         "< 60 s"),
        ("kill -9 -> every process it started gone", statistics.median(k[1] for k in kills),
         "< 10 s"),
    ]  # fmt: skip
    print(f"\nmain job (PSI + vertical LR), 3 organisations, median of {args.repeats}")
    print(f"{'what':<44} {'seconds':>8}  target")
    for what, seconds, target in rows:
        print(f"{what:<44} {seconds:8.1f}  {target}")
    print(
        "each run:", [round(x, 1) for x in failures], [tuple(round(v, 1) for v in k) for k in kills]
    )


if __name__ == "__main__":
    main()
