"""``privreg job``: a job run as one object across the federation, seen from one party.

privreg job status JOB --config party.toml     every party's state and when it was last heard
privreg job abort JOB --config party.toml --reason TEXT
                                              end the job at this party, and so at every peer

``JOB`` is the job run's name as the parties agreed it: the job file's ``job``, with
``-<run>`` for a scheduled re-run (``demo``, ``demo-nightly-2026-11-26``); sub-jobs are named
by their own files (``horizontal_demo``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def _transport(config_path: str) -> tuple[Any, Any]:
    """This party's configuration and network transport (imported late: a fast ``--help``)."""
    from storage.party_config import PartyConfig
    from storage.transport_grpc import transport_for

    config = PartyConfig.load(config_path)
    return config, transport_for(config)


def _status(args: argparse.Namespace) -> None:
    from storage.channel import ChannelError
    from storage.federation import PartyStatus, PeerView

    config, transport = _transport(args.config)
    own = transport.store().read_status(args.job, config.party)
    if own is None:
        raise SystemExit(
            f"privreg: party {config.party} has no state for job {args.job} "
            f"(no side of it ever ran under {config.root})"
        )
    mine = PartyStatus.from_bytes(own)
    now = time.time()
    print(f"job {args.job} as {config.party} sees it ({time.strftime('%H:%M:%S')}):")
    heard = PeerView(config.party, mine, heard=mine.heartbeat)
    print(heard.line(now))
    for peer in mine.parties:
        if peer == config.party:
            continue
        view = PeerView(peer)
        try:
            data = transport.peer_status(args.job, peer)
            if data is not None:
                view.status = PartyStatus.from_bytes(data)
                view.heard = view.status.heartbeat  # the peer's clock: skew shows here
        except ChannelError as error:
            view.error = f"unreachable: {error}"
        print(view.line(now))


def _abort(args: argparse.Namespace) -> None:
    from storage.federation import request_abort

    config, transport = _transport(args.config)
    record = request_abort(transport, args.job, config.party, args.reason)
    peers = ", ".join(p for p in record.parties if p != config.party)
    print(f"job {args.job}: aborted at {config.party}; {peers} hear it within seconds")


def register(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add ``job`` and its actions to the ``privreg`` command; returns its actions."""
    job = commands.add_parser("job", help="one job run across every party: state, abort")
    actions = job.add_subparsers(dest="job_command", required=True)
    status = actions.add_parser(
        "status", help="every party's state of a job run and when it was last heard from"
    )
    status.add_argument("job", help="the job run's name, e.g. demo or demo-<run>")
    status.add_argument("--config", required=True, help="this party's party.toml")
    status.set_defaults(handler=_status)
    abort = actions.add_parser("abort", help="end a job run here and at every peer")
    abort.add_argument("job", help="the job run's name, e.g. demo or demo-<run>")
    abort.add_argument("--config", required=True, help="this party's party.toml")
    abort.add_argument("--reason", required=True, help="told to every party")
    abort.set_defaults(handler=_abort)
    return actions
