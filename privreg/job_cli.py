"""``privreg job``: a job run as one object across the federation, seen from one party.

privreg job start FILE --config party.toml [--run RUN]
                                              propose a run to every peer, run this side
privreg job resume FILE --config party.toml --run RUN
                                              restart this party's side of a run (at any
                                              party): every side resumes from its checkpoints
privreg job schedule FILE --config party.toml --cron "0 2 * * *"
                                              a recurring run (serves until stopped)
privreg job status JOB --config party.toml [--watch] [--json]
                                              every party's state and when it was last heard;
                                              a party silent as long as its peers allow: down
privreg job approve JOB --config party.toml    a person's yes to a proposed run (manual policy)
privreg job decline JOB --config party.toml --reason TEXT
privreg job abort JOB --config party.toml --reason TEXT
                                              end the job at this party, and so at every peer

``JOB`` is the job run's name as the parties agreed it: the job file's ``job``, with
``-<run>`` for a scheduled re-run (``demo``, ``demo-nightly-2026-11-26``); sub-jobs are named
by their own files (``horizontal_demo``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from privreg.run_log import flow_command, log_path


def _transport(config_path: str) -> tuple[Any, Any]:
    """This party's configuration and network transport (imported late: a fast ``--help``)."""
    from federation.party_config import PartyConfig
    from federation.transport_grpc import transport_for

    config = PartyConfig.load(config_path)
    return config, transport_for(config)


def _status(args: argparse.Namespace) -> None:
    """Every party's state once, or (``--watch``) every ``--every`` seconds until no side is
    live; Ctrl-C ends a watch quietly. ``--json``: the same as JSON, one object per look."""
    config, transport = _transport(args.config)
    try:
        while True:
            views = _views(config, transport, args.job)
            print(_shown(args, config.party, views), flush=True)
            if not args.watch or not _running(views):
                return
            time.sleep(args.every)
    except KeyboardInterrupt:
        if not args.watch:
            raise


def _shown(args: argparse.Namespace, party: str, views: list[Any]) -> str:
    """One look at every party: lines for a person, or one JSON object for a script."""
    now = time.time()
    if args.json:
        return json.dumps({"job": args.job, "as_seen_by": party, "at": now,
                           "parties": [view.as_dict(now) for view in views]})  # fmt: skip
    lines = [f"job {args.job} as {party} sees it ({time.strftime('%H:%M:%S')}):"]
    shown = "\n".join([*lines, *(view.line(now) for view in views)])
    if args.watch and sys.stdout.isatty():
        return _CLEAR + shown  # in place: the terminal shows the latest look only
    return shown


_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def _views(config: Any, transport: Any, job: str) -> list[Any]:
    """This party's view of every party of ``job`` (itself first), each judged down by the
    rule its peers use: a live record not rewritten for ``federation.status.DOWN_AFTER``."""
    from federation.channel import ChannelError
    from federation.status import PartyStatus, PeerView

    own = transport.store().read_status(job, config.party)
    if own is None:
        raise SystemExit(
            f"privreg: party {config.party} has no state for job {job} "
            f"(no side of it ever ran under {config.root})"
        )
    mine = PartyStatus.from_bytes(own)
    views = [PeerView(config.party, mine, heard=mine.heartbeat)]
    for peer in mine.parties:
        if peer == config.party:
            continue
        view = PeerView(peer)
        try:
            data = transport.peer_status(job, peer)
            if data is not None:
                view.status = PartyStatus.from_bytes(data)
                view.heard = view.status.heartbeat  # the peer's clock: skew shows here
        except ChannelError as error:
            view.error = f"unreachable: {error}"
        views.append(view)
    now = time.time()
    for view in views:
        view.judge_silence(now)
    return views


def _running(views: list[Any]) -> bool:
    """Whether the run goes on: some party's side is live (a down one may still restart)."""
    from federation.status import LIVE

    return any(view.status is not None and view.status.state in LIVE for view in views)


def _as_party(config_path: str) -> Any:
    from privreg.party_cli import _as_party as become

    return become(config_path)


def _relative_job_file(args: argparse.Namespace) -> str:
    """The job file as a path inside the party's folder (how every peer finds its copy)."""
    job_file, folder = Path(args.job_file).resolve(), Path(args.config).resolve().parent
    if not job_file.is_relative_to(folder):
        raise SystemExit(f"privreg: the job file must be inside the party's folder {folder}")
    return str(job_file.relative_to(folder))


def _org_prefect(config: Any) -> str | None:
    """Use the organisation's Prefect server (the one ``privreg party serve`` hosts, or
    ``PREFECT_API_URL``) when it answers: the run lands beside the sides its service started,
    in the UI that stays up. Called before Prefect is imported (its settings are read then)."""
    from privreg.org_prefect import use_org_prefect

    return use_org_prefect(config)


def _start(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    job_file = _relative_job_file(args)
    log = _log(config, job_file)
    _org_prefect(config)
    with flow_command(log, f"privreg job {args.job_command} {job_file}"):
        from flows.job_start import start_job  # Prefect only for a command that runs a flow

        result = start_job(job_file, args.run, restart=args.job_command == "resume")
    for stage in result.stages:
        print(stage.line(config.party), flush=True)
    print(f"log: {log}", file=sys.stderr)


def _log(config: Any, job_file: str) -> Path:
    """A new file for Prefect's lines of one command, under the party's own folder."""
    return log_path(Path(config.root) / "logs", Path(job_file).stem)


def _schedule(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    job_file = _relative_job_file(args)
    name = f"{config.party}-{Path(job_file).stem}"
    log = _log(config, job_file)
    if _org_prefect(config) is None:  # a temporary server ends with this command
        raise SystemExit(
            f"privreg: job schedule needs a Prefect server that stays up: start `privreg party "
            f"serve --config {args.config}` (it hosts the organisation's) or set PREFECT_API_URL"
        )
    print(f"{config.party}: proposing {job_file} on cron {args.cron!r} (deployment {name}; "
          f"log {log})", flush=True)  # fmt: skip
    with flow_command(log, f"privreg job schedule {job_file}"):
        from flows.job_start import start_job

        start_job.serve(name=name, cron=args.cron, parameters={"job_file": job_file})


def _answer(args: argparse.Namespace) -> None:
    config, transport = _transport(args.config)
    from federation.status import beside_status

    where = beside_status(transport, args.job, config.party, "flow_run")
    if not where.exists():
        raise SystemExit(f"privreg: no run of job {args.job} awaits approval at {config.party}")
    approve = args.job_command == "approve"
    flow_run_id = where.read_text().split()[0]
    _org_prefect(config)  # where the service's side paused
    with flow_command(_log(config, args.job), f"privreg job {args.job_command} {args.job}"):
        from prefect.flow_runs import resume_flow_run

        _wait_until_paused(flow_run_id, args.job)
        resume_flow_run(flow_run_id, run_input={"approve": approve, "reason": args.reason})
    print(f"job {args.job}: {'approved' if approve else 'declined'} at {config.party}")


def _wait_until_paused(flow_run_id: str, job: str, patience: float = 60.0) -> None:
    """The side announces "approval" just before its run pauses: an answer given in between
    would be lost, so wait (a little) for the pause itself."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + patience
    with get_client(sync_client=True) as client:
        while not (state := client.read_flow_run(flow_run_id).state) or not state.is_paused():
            if state is not None and state.is_final():
                raise SystemExit(f"privreg: job {job} ended here already ({state.name})")
            if time.monotonic() > deadline:
                raise SystemExit(f"privreg: job {job}'s run here is not waiting for an answer")
            time.sleep(0.5)


def _abort(args: argparse.Namespace) -> None:
    from federation.status import request_abort

    config, transport = _transport(args.config)
    record = request_abort(transport, args.job, config.party, args.reason)
    peers = ", ".join(p for p in record.parties if p != config.party)
    print(f"job {args.job}: aborted at {config.party}; {peers} hear it within seconds")


def register(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add ``job`` and its actions to the ``privreg`` command; returns its actions."""
    job = commands.add_parser("job", help="one job run across every party: state, abort")
    actions = job.add_subparsers(dest="job_command", required=True)

    def action(name: str, help_text: str, handler: Any, target: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=help_text)
        if target == "file":
            parser.add_argument("job_file", help="the job file, inside this party's folder")
        else:
            parser.add_argument("job", help="the job run's name, e.g. demo or demo-<run>")
        parser.add_argument("--config", required=True, help="this party's party.toml")
        parser.set_defaults(handler=handler)
        return parser

    status = action(
        "status", "every party's state of a job run and when it was last heard from; a party "
        "whose heartbeat stopped shows as down", _status, "run",
    )  # fmt: skip
    status.add_argument(
        "--watch", action="store_true", help="refresh in place until the run ends (or Ctrl-C)"
    )
    status.add_argument("--every", type=float, default=2.0, help="--watch: seconds between looks")
    status.add_argument(
        "--json", action="store_true", help="print JSON for scripts (one object per look)"
    )
    start = action("start", "propose a job run to every peer and run this side", _start, "file")
    start.add_argument("--run", default="", help="the run's name (default: the UTC time)")
    resume = action(
        "resume", "restart this party's side of a run: every side resumes", _start, "file"
    )
    resume.add_argument("--run", required=True, help="the run to resume")
    schedule = action("schedule", "propose a fresh run on a cron schedule", _schedule, "file")
    schedule.add_argument("--cron", required=True, help='e.g. "0 2 * * *" (02:00 every day)')
    for verdict in ("approve", "decline"):
        answer = action(verdict, f"{verdict} a proposed run (manual policy)", _answer, "run")
        answer.add_argument(
            "--reason", default="", required=verdict == "decline", help="told to the proposer"
        )
    abort = action("abort", "end a job run here and at every peer", _abort, "run")
    abort.add_argument("--reason", required=True, help="told to every party")
    return actions
