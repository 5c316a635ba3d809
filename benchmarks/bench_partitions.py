"""Links cut, endpoints restarted, certificates renewed mid-job: organisations in namespaces.

Usage: python benchmarks/bench_partitions.py [--only psi|vertical|horizontal]
       [--case none|cut|restart|renew] [--long 45]

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
  should end done. The horizontal job tolerates dropouts down to its threshold (two of three
  hospitals), so there the cut hospital may be dropped and the model differ; the case runs
  again with every hospital required (threshold three of three), where nothing may drop;
* the victim's endpoint (``privreg party serve``) killed and started again;
* renew: every party's certificate and key replaced on disk by freshly issued ones (same CA,
  same name), each moved over the file in use; the case names how many messages were then
  received signed with the new certificates (none would mean the renewal was not exercised).

The table: each party's outcome and the seconds from its run's start to its exit (first,
then after the resume when there was one), whether
the models equal an uncut run's bit for bit (holdout off, so the runs' names do not draw other
rows), whether the messages received are the uncut run's (none lost or extra) each with its
sender's bytes, and the case's seconds (start to the last party's end, resume included). For
the horizontal job, each row also names the hospitals some round went on without. Each failed
party's reason follows the table in full.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import partitions, wan
from demo.parties import SMALL_KEYS

LINK = wan.Setting("WAN (partitions)", 100, 4)
SHORT_PATIENCE = 20.0  # restart grace and receive timeout of the case cut longer than both
PATIENCE = 120.0
STAGES = {"psi": partitions.PSI, "vertical": partitions.VERTICAL,
          "horizontal": partitions.HORIZONTAL_ROUND}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """One case of a stage: what happens, how long the cut lasts, the restart grace and
    receive timeout, and the horizontal job's threshold (None: the job's own)."""

    action: str
    length: float
    patience: float
    threshold: int | None = None


def cases(stage: partitions.Stage, long: float) -> list[Spec]:
    """The cases of ``stage``, in order; the horizontal long cut twice: with the job's own
    threshold (the cut hospital may be dropped) and with every hospital required."""
    specs = [Spec("none", 0, PATIENCE), Spec("cut", 5, PATIENCE), Spec("cut", 60, PATIENCE),
             Spec("cut", long, SHORT_PATIENCE)]  # fmt: skip
    if stage is partitions.HORIZONTAL_ROUND:
        hospitals = len(partitions.HOSPITALS) - 1  # all but the coordinator
        specs.append(Spec("cut", long, SHORT_PATIENCE, hospitals))
    return [*specs, Spec("restart", 0, PATIENCE), Spec("renew", 0, PATIENCE)]


def short(reason: str, width: int = 120) -> str:
    """A failure's reason cut for the table; the reasons in full follow it."""
    return reason if len(reason) <= width else reason[: width - 1] + "…"


def outcome_cell(case: partitions.Case) -> str:
    """Each party's end; when some failed, their reasons and the resumed run's ends."""
    first = ", ".join(str(o) for o in case.first.values())
    if not case.resumed:
        return first
    reasons = "; ".join(f"{p}: {short(o.reason)}" for p, o in case.first.items() if o.code)
    final = ", ".join(str(o) for o in case.final.outcomes.values())
    return f"{first} ({reasons}) → resumed: {final}"


def case_name(case: partitions.Case, spec: Spec) -> str:
    name = {"none": "no cut (control)", "cut": f"{case.stage.victim}'s link cut",
            "restart": f"{case.stage.victim}'s endpoint restarted",
            "renew": "every party's certificate and key renewed "
                     f"({case.renewed} messages then received signed with the new ones)",
            }[case.action]  # fmt: skip
    if case.stage is partitions.HORIZONTAL_ROUND:
        hospitals = len(partitions.HOSPITALS) - 1
        needed = "the job's own" if spec.threshold is None else "none may drop"
        dropped = ", ".join(case.dropped()) or "none"
        threshold = spec.threshold or partitions.own_threshold()
        name += f"; threshold {threshold} of {hospitals} ({needed}), rounds without: {dropped}"
    return name


def row(case: partitions.Case, uncut: partitions.Result, spec: Spec) -> str:
    length = f"{case.length:g} s" if case.action == "cut" else "-"
    yes = {True: "yes", False: "no"}
    return (
        f"| {case.stage.name} | {case_name(case, spec)} | {length} | {spec.patience:g} s "
        f"| {outcome_cell(case)} | {yes[case.final.same_model(uncut)]} "
        f"| {yes[case.final.same_messages(uncut)]} | {yes[case.mid_job]} | {case.seconds:.1f} |"
    )


def failure_lines(case: partitions.Case, spec: Spec) -> list[str]:
    """Each party that failed before the resume, with its reason in full."""
    where = f"{case.stage.name}, {case_name(case, spec)}, cut {case.length:g} s"
    return [f"* {where}: {p}: {o.reason}" for p, o in case.first.items() if o.code]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(STAGES))
    parser.add_argument("--long", type=float, default=45.0, help="the cut past the grace, s")
    parser.add_argument("--case", choices=["none", "cut", "restart", "renew"],
                        help="only the cases of this kind")  # fmt: skip
    args = parser.parse_args()
    if reason := wan.available():
        raise SystemExit(f"bench-partitions {reason}")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    stages = [STAGES[args.only]] if args.only else list(STAGES.values())
    lines, failures, loads = [], [], [os.getloadavg()]
    parties = partitions.MAIN_PARTIES + partitions.HOSPITALS
    with (
        prefect_test_harness(server_startup_timeout=180),
        tempfile.TemporaryDirectory() as tmp,
        wan.Wan(parties, LINK) as net,
    ):
        port = int(str(PREFECT_API_URL.value()).split(":")[-1].split("/")[0])
        fed = partitions.Federation(Path(tmp), net, port, SMALL_KEYS)
        for stage in stages:
            for k, spec in enumerate(cases(stage, args.long)):
                if args.case and spec.action != args.case:
                    continue
                fed.patience(spec.patience, spec.patience)
                fed.require(None)
                uncut = partitions.reference(fed, stage)
                fed.require(spec.threshold)
                run = f"{stage.stage.replace('_', '')}{k}-{int(time.time())}"
                case = partitions.run_case(fed, stage, spec.action, spec.length, run)
                lines.append(row(case, uncut, spec))
                failures += failure_lines(case, spec)
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
    if failures:
        print("\nEach failed party's reason in full (before the resume):\n")
        print("\n".join(failures))
    one_minute = sorted(load[0] for load in loads)
    median = statistics.median(one_minute)
    print(
        f"\nLoad (1-minute, at the start and after each case): median {median:.1f}, "
        f"range {one_minute[0]:.1f}-{one_minute[-1]:.1f}"
    )


if __name__ == "__main__":
    main()
