"""How fast a job's failures reach every organisation (``make bench-federation``).

Three organisations as their own processes over mTLS on loopback (the clinic as guest, the lab
as host, the arbiter), each with its own temporary Prefect, run the demo's main job (PSI, one
vertical epoch, 1024-bit keys). Measured, median of ``--repeats`` runs:

* failure to every peer: the clinic fails at set-up (its source lacks the label column); the
  time from its exit to the last peer's exit (target: under 10 s);
* kill -9 to "down": the lab's side is killed while its Paillier pool works; the time until
  the clinic and the arbiter report it down in their logs (the job's ``down_after``, 30 s,
  plus at most one poll), and until every process the lab's side started is gone.

Horizontal LR (``jobs/horizontal_demo.json``: three hospitals and a coordinator, threshold 2):

* below threshold to every survivor: two hospitals fail at load (their sources lack the label
  column); the coordinator waits for the hospitals' columns (``join_timeout`` 15 s here), fails
  naming the missing ones, and the time from its exit to the surviving hospital's exit is
  measured (target: under 10 s). The failed hospitals end nobody's side: their failure is a
  dropout the protocol's threshold judges.
* rounds with a dropped hospital against none: the coordinator and three hospitals as
  ``privreg party horizontal`` processes, 10 rounds; in one run hospital_c is killed before it
  masks in round 2 and stays gone. The median round (one round's start to the next's) of
  rounds 3-9 of that run against the same rounds of an undisturbed run (target: within 1.5x);
  round 2 itself waits out the stage deadline (5 s here) and is shown apart.

A proposed side's start, with and without the organisation's Prefect server (``--sections
prefect``): the lab's service (in this process, as ``privreg party serve`` runs it) takes the
clinic's proposal of the small main job, once for one side and once for two at once; measured
are the seconds from the proposal to each side's first flow-run log line ("Beginning flow
run"), the processes the sides run and all the processes under the service at that moment,
and their resident memory. Without the server each side starts a temporary Prefect of its
own; with it, the server's own start (once per organisation) is shown apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.horizontal_rounds import HOSPITALS, _tables
from core.job_files import read_job
from core.lifetime import descendants
from core.test_switches import PARTY_FAULT_VARIABLE
from demo.orgs import Org, env_of, make_orgs, serve_all, start
from demo.parties import SMALL_KEYS, accept_proposals, prepare, small_main_job
from federation.party_config import PartyConfig
from federation.status import Proposal
from privreg.org_prefect import OrgPrefect
from privreg.party_service import PartyService

ROOT = Path(__file__).resolve().parents[1]
PATIENCE = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **SMALL_KEYS}


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


HORIZONTAL = "jobs/horizontal_demo.json"
HORIZONTAL_PARTIES = ("hospital_a", "hospital_b", "hospital_c", "coordinator")


def horizontal_source(source: Path) -> None:
    """The demo's job files under ``source`` with horizontal LR as the one sub-job (4 rounds,
    a 15 s wait for the hospitals' columns); only its parties' sides are started."""
    main = read_job(ROOT / "jobs/demo.json")
    main["subjobs"] = {"horizontal_lr": HORIZONTAL}
    job = read_job(ROOT / HORIZONTAL)
    job["horizontal_lr"].update(rounds=4, join_timeout=15)
    (source / "jobs").mkdir(parents=True)
    (source / "jobs/demo.json").write_text(json.dumps(main))
    (source / HORIZONTAL).write_text(json.dumps(job))
    (source / "demo").symlink_to(ROOT / "demo")


def below_threshold_to_survivor(orgs: dict[str, Org], run: str, logs: Path) -> float:
    broken = {h: orgs[h].folder / f"demo/horizontal/{h}.csv" for h in ("hospital_b", "hospital_c")}
    for path in broken.values():  # each organisation's own copy
        path.unlink()
        path.write_text("patient_id,x1\np1,0.5\n")
    args = ["--job-file", "jobs/demo.json", "--run", run]
    running = {}
    for party in HORIZONTAL_PARTIES:
        with (logs / f"{party}-{run}.log").open("w") as log:
            running[party] = start(orgs[party], "pipeline", args, PATIENCE, stderr=log)
    try:
        ended = wait_all(running, 300)
    finally:
        for party, path in broken.items():
            path.unlink()
            shutil.copy(ROOT / f"demo/horizontal/{party}.csv", path)
    log = (logs / f"hospital_a-{run}.log").read_text()
    if "party coordinator failed" not in log:
        raise RuntimeError(f"hospital_a did not end on the coordinator's failure:\n{log[-2000:]}")
    return ended["hospital_a"] - ended["coordinator"]


def wait_all(running: dict[str, subprocess.Popen], patience: float) -> dict[str, float]:
    """When each process exited (monotonic seconds); kills the rest after ``patience``."""
    ended: dict[str, float] = {}
    deadline = time.monotonic() + patience
    while len(ended) < len(running):
        for party, process in running.items():
            if party not in ended and process.poll() is not None:
                ended[party] = time.monotonic()
        if time.monotonic() > deadline:
            for process in running.values():
                if process.poll() is None:
                    process.kill()
            raise TimeoutError(f"still running after {patience:.0f} s: {set(running) - set(ended)}")
        time.sleep(0.05)
    return ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sections", default="main,horizontal,dropped,prefect", help="comma-separated, of these"
    )
    parser.add_argument("--keep", action="store_true", help="keep the folders and logs")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    folder = tempfile.mkdtemp(prefix="privreg-bench-federation-")
    root, logs = Path(folder), Path(folder) / "logs"
    logs.mkdir()
    try:
        if "main" in sections:
            main_job(root, logs, args.repeats)
        if "horizontal" in sections:
            horizontal_job(root, logs, args.repeats)
        if "dropped" in sections:
            dropped_job(root, args.repeats)
        if "prefect" in sections:
            prefect_start(root)
    finally:
        if args.keep:
            print(f"folders and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def main_job(root: Path, logs: Path, repeats: int) -> None:
    small_main_job(root / "source")
    orgs = prepare(root / "orgs", source=root / "source", receive_timeout=300)
    servers = serve_all(orgs.values())
    try:
        failures = [failure_to_every_peer(orgs, f"f{i}", logs) for i in range(repeats)]
        kills = [kill_to_down(orgs, f"k{i}", logs) for i in range(repeats)]
    finally:
        stop(servers)
    rows = [
        ("failure at set-up -> last peer's exit", statistics.median(failures), "< 10 s"),
        ("kill -9 -> down reported by both peers", statistics.median(k[0] for k in kills),
         "< 60 s"),
        ("kill -9 -> every process it started gone", statistics.median(k[1] for k in kills),
         "< 10 s"),
    ]  # fmt: skip
    print(f"\nmain job (PSI + vertical LR), 3 organisations, median of {repeats}")
    print(f"{'what':<48} {'seconds':>8}  target")
    for what, seconds, target in rows:
        print(f"{what:<48} {seconds:8.1f}  {target}")
    print(
        "each run:", [round(x, 1) for x in failures], [tuple(round(v, 1) for v in k) for k in kills]
    )


def horizontal_job(root: Path, logs: Path, repeats: int) -> None:
    horizontal_source(root / "hsource")
    orgs = prepare(root / "horgs", source=root / "hsource", receive_timeout=300)
    hospitals = {party: orgs[party] for party in HORIZONTAL_PARTIES}
    servers = serve_all(hospitals.values())
    try:
        survivors = [below_threshold_to_survivor(hospitals, f"h{i}", logs) for i in range(repeats)]
    finally:
        stop(servers)
    print(f"\nhorizontal LR, 3 hospitals + coordinator, median of {repeats}")
    what = "coordinator below threshold -> survivor's exit"
    print(f"{what:<48} {statistics.median(survivors):8.1f}  < 10 s")
    print("each run:", [round(x, 1) for x in survivors])


def rounds_with_a_drop(folder: Path, drop: bool, rounds: int = 10) -> dict[int, float]:
    """Seconds of each round (its start to the next's) of horizontal LR as processes; with
    ``drop``, hospital_c is killed before it masks in round 2."""
    orgs = make_orgs(folder, ["coordinator", *HOSPITALS], receive_timeout=600)
    refs = _tables(folder / "tables")
    servers = serve_all(orgs.values(), PATIENCE)
    common = ["--job", "bench-drop", "--parties", ",".join(HOSPITALS), "--learning-rate", "0.5"]
    common += ["--threshold", "2", "--stage-timeout", "5"]  # the agreed terms, at every side
    running: dict[str, subprocess.Popen] = {}
    try:
        running["coordinator"] = start(
            orgs["coordinator"], "horizontal",
            [*common, "--rounds", str(rounds), "--tol", "0"], PATIENCE,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for name in HOSPITALS:
            args = [*common, "--table", json.dumps(refs[name].to_dict())]
            env = dict(PATIENCE)
            if drop and name == "hospital_c":  # the test switch of this process only
                env[PARTY_FAULT_VARIABLE] = "bench-drop:2:mask_input:kill"
            running[name] = start(orgs[name], "horizontal", args, env, stderr=subprocess.DEVNULL)
        out, _ = running["coordinator"].communicate(timeout=1800)
        if running["coordinator"].returncode:
            raise RuntimeError("the coordinator failed")
    finally:
        for process in [*running.values(), *servers]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=60)
    history = json.loads(out.strip().splitlines()[-1])["history"]
    starts = [entry["started_at"] for entry in history]
    return {k: starts[k + 1] - starts[k] for k in range(len(starts) - 1)}


def dropped_job(root: Path, repeats: int) -> None:
    none = [rounds_with_a_drop(root / f"none{i}", drop=False) for i in range(repeats)]
    gone = [rounds_with_a_drop(root / f"drop{i}", drop=True) for i in range(repeats)]
    later = range(3, 9)  # rounds 3-8: the gap from a round's start to the next round's start

    def median_of(runs: list[dict[int, float]], keys: range | list[int]) -> float:
        return statistics.median(run[k] for run in runs for k in keys)

    normal, dropped = median_of(none, later), median_of(gone, later)
    print(f"\nhorizontal LR processes, 3 hospitals, 10 rounds, median of {repeats} run(s)")
    print(f"{'what':<48} {'seconds':>8}  target")
    print(f"{'a round, nobody dropped (rounds 3-8)':<48} {normal:8.2f}")
    print(f"{'a round, hospital_c gone since round 2 (3-8)':<48} {dropped:8.2f}")
    print(f"{'ratio':<48} {dropped / normal:8.2f}  < 1.5")
    print(f"{'round 2 itself (waits the 5 s stage deadline)':<48} {median_of(gone, [2]):8.2f}")


FIRST_FLOW_LINE = "Beginning flow run"


def _rss_mb(pids: set[int]) -> float:
    """Resident memory of ``pids`` (Linux /proc), MB."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmRSS:")), 0)  # fmt: skip
    return total / 1024


def proposed_sides(
    service: PartyService, org: Org, runs: list[str]
) -> tuple[float, int, int, float]:
    """Propose ``runs`` at once; when every side has logged its first flow-run line: the
    seconds until the last did, the sides' processes, the service's, and their RSS (MB)."""
    began = time.monotonic()
    for run in runs:
        service("clinic", Proposal("jobs/demo.json", run))
    logs = [org.folder / "home" / "runs" / f"demo-{run}" / "pipeline.log" for run in runs]
    while not all(log.exists() and FIRST_FLOW_LINE in log.read_text() for log in logs):
        if time.monotonic() - began > 300:
            raise TimeoutError(f"no flow-run line within 300 s: {logs}")
        time.sleep(0.1)
    seconds = time.monotonic() - began
    sides = {side.pid for _, side in service._sides.values()}
    side_family = sides.union(*(descendants(pid) for pid in sides))
    everything = descendants(os.getpid())
    return seconds, len(side_family), len(everything), _rss_mb(everything)


def prefect_start(root: Path) -> None:
    """A proposed side's start, with and without the organisation's Prefect server."""
    small_main_job(root / "psource")
    orgs = prepare(root / "porgs", source=root / "psource", receive_timeout=60)
    accept_proposals(orgs)
    lab = orgs["lab"]
    config = PartyConfig.load(lab.config)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env_of(lab, SMALL_KEYS))  # what `party serve` would run the sides with
    rows = []
    try:
        for org_server in (False, True):
            prefect, up = None, 0.0
            if org_server:
                prefect = OrgPrefect.for_party(config)
                prefect.wait_ready(say=lambda _line: None)
                up = time.time() - prefect.since
            try:
                for count in (1, 2):
                    service = PartyService(config, lab.config, prefect)
                    runs = [f"p{int(org_server)}-{count}-{i}" for i in range(count)]
                    try:
                        rows.append((org_server, count, *proposed_sides(service, lab, runs)))
                    finally:
                        service.stop()
            finally:
                if prefect is not None:
                    prefect.stop()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print("\na proposed side's start (the lab's service, the clinic's proposal of the small "
          "main job)")  # fmt: skip
    if up:
        print(f"the organisation's Prefect server itself: up in {up:.1f} s (fresh database), "
              "once per service start")  # fmt: skip
    print(f"{'Prefect':<28} {'sides':>5} {'s to first flow line':>21} {'side procs':>10} "
          f"{'all procs':>9} {'RSS MB':>7}")  # fmt: skip
    for org_server, count, seconds, side_procs, procs, rss in rows:
        where = "organisation's server" if org_server else "temporary per side"
        print(f"{where:<28} {count:>5} {seconds:>21.1f} {side_procs:>10} {procs:>9} {rss:>7.0f}")


def stop(servers: list[subprocess.Popen]) -> None:
    for server in servers:
        server.terminate()
    for server in servers:
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
