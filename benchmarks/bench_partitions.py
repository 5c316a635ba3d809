"""Partitions and restarts mid-job, between organisations in their own namespaces.

Usage: python benchmarks/bench_partitions.py [--only psi|vertical|horizontal] [--long 45]

Needs root (benchmarks/wan.py). Seven organisations on one harness (100 Mbit/s, 4 ms RTT):
the clinic, the lab and the arbiter run the demo's main job shrunk (PSI, then one vertical LR
epoch, 1024-bit keys), three hospitals and the coordinator the demo's horizontal job (20
rounds), each with ``privreg party pipeline`` in its namespace. Per stage (PSI, a vertical
round, a horizontal round), once a party has received some of the stage's messages:

* none: the control, an uncut run under another name (its model must equal the reference);
* the victim's link cut (interfaces down) for 5 s and 60 s, with a restart grace and receive
  timeout of 120 s: the job should end done everywhere;
* a cut longer than a grace and timeout of 20 s: every party should end FAILED naming the
  party it cannot hear, and the same run resumed at every party once the link is back
  should end done;
* the victim's endpoint (``privreg party serve``) killed and started again.

The table: each party's outcome and the seconds from its run's start to its exit (first,
then after the resume when there was one), whether
the models equal an uncut run's bit for bit (holdout off, so the runs' names do not draw other
rows), whether the messages received are the uncut run's (none lost or extra) each with its
sender's bytes, and the case's seconds (start to the last party's end, resume included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import partitions, wan
from demo.parties import SMALL_KEYS

LINK = wan.Setting("WAN (partitions)", 100, 4)
SHORT_PATIENCE = 20.0  # restart grace and receive timeout of the case cut longer than both
PATIENCE = 120.0
STAGES = {"psi": partitions.PSI, "vertical": partitions.VERTICAL,
          "horizontal": partitions.HORIZONTAL_ROUND}  # fmt: skip


def cases(long: float) -> list[tuple[str, float, float]]:
    """(action, cut seconds, patience) of each case, in order."""
    return [("none", 0, PATIENCE), ("cut", 5, PATIENCE), ("cut", 60, PATIENCE),
            ("cut", long, SHORT_PATIENCE), ("restart", 0, PATIENCE)]  # fmt: skip


def outcome_cell(case: partitions.Case) -> str:
    """Each party's end; when some failed, their reasons and the resumed run's ends."""
    first = ", ".join(str(o) for o in case.first.values())
    if not case.resumed:
        return first
    reasons = "; ".join(
        f"{p}: {o.reason.split('error: ', 1)[-1][:140]}" for p, o in case.first.items() if o.code
    )
    final = ", ".join(str(o) for o in case.final.outcomes.values())
    return f"{first} ({reasons}) → resumed: {final}"


def row(case: partitions.Case, uncut: partitions.Result, patience: float) -> str:
    name = {"none": "no cut (control)", "cut": f"{case.stage.victim}'s link cut",
            "restart": f"{case.stage.victim}'s endpoint restarted"}[case.action]  # fmt: skip
    length = f"{case.length:g} s" if case.action == "cut" else "-"
    yes = {True: "yes", False: "no"}
    return (
        f"| {case.stage.name} | {name} | {length} | {patience:g} s | {outcome_cell(case)} "
        f"| {yes[case.final.same_model(uncut)]} | {yes[case.final.same_messages(uncut)]} "
        f"| {yes[case.mid_job]} | {case.seconds:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(STAGES))
    parser.add_argument("--long", type=float, default=45.0, help="the cut past the grace, s")
    args = parser.parse_args()
    if reason := wan.available():
        raise SystemExit(f"bench-partitions {reason}")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    stages = [STAGES[args.only]] if args.only else list(STAGES.values())
    lines, loads = [], [os.getloadavg()]
    parties = partitions.MAIN_PARTIES + partitions.HOSPITALS
    with (
        prefect_test_harness(server_startup_timeout=180),
        tempfile.TemporaryDirectory() as tmp,
        wan.Wan(parties, LINK) as net,
    ):
        port = int(str(PREFECT_API_URL.value()).split(":")[-1].split("/")[0])
        fed = partitions.Federation(Path(tmp), net, port, SMALL_KEYS)
        for stage in stages:
            for k, (action, length, patience) in enumerate(cases(args.long)):
                fed.patience(patience, patience)
                uncut = partitions.reference(fed, stage)
                run = f"{stage.stage.replace('_', '')}{k}-{int(time.time())}"
                case = partitions.run_case(fed, stage, action, length, run)
                lines.append(row(case, uncut, patience))
                loads.append(os.getloadavg())
                print(lines[-1], file=sys.stderr, flush=True)
    print(f"\n### Partitions and restarts ({LINK.mbit:g} Mbit/s, {LINK.rtt_ms:g} ms RTT)\n")
    print(
        "| stage | case | cut | restart grace = receive timeout | outcome at each party "
        "| model equal to uncut | messages equal (none lost or extra, sender's bytes) "
        "| interrupted mid-job | s |"
    )
    print("|---|---|---:|---:|---|---|---|---|---:|")
    print("\n".join(lines))
    one_minute = sorted(load[0] for load in loads)
    median = statistics.median(one_minute)
    print(
        f"\nLoad (1-minute, at the start and after each case): median {median:.1f}, "
        f"range {one_minute[0]:.1f}-{one_minute[-1]:.1f}"
    )


if __name__ == "__main__":
    main()
