"""``privreg certs`` and ``privreg party``: what one organisation runs to join over the network.

privreg certs init --out DIR                      a demo CA (DIR/ca.pem, DIR/ca.key)
privreg certs issue --ca DIR --party NAME --out DIR
privreg party serve --config party.toml [--flows] its message endpoint (mTLS gRPC) [and flows]
privreg party psi --config party.toml --table DESCRIPTOR --peer NAME --job JOB [--min-rows N]
privreg party vertical --config party.toml --job JOB --role ROLE --guest NAME --hosts A,B
    [--table DESCRIPTOR] [--arbiter NAME | --no-arbiter] [--options JSON]

A command under ``party`` runs as the configured party only: its channel is its own folder and
the network, and it is given no other party's path.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any


def _certs(args: argparse.Namespace) -> None:
    from storage import certs

    if args.action == "init":
        issued = certs.create_ca(args.out, name=args.name)
    else:
        if not args.party:
            raise SystemExit("certs issue needs --party")
        ca_dir = Path(args.ca)
        issued = certs.issue(
            certs.Issued(ca_dir / "ca.pem", ca_dir / "ca.key"), args.party, args.out
        )
    print(f"certificate {issued.cert}\nprivate key {issued.key} (mode 0600)")


def _as_party(config_path: str) -> Any:
    """Load the configuration and make this whole process that party (read by channel_for)."""
    from storage.party_config import ENV_VAR, PartyConfig

    config = PartyConfig.load(config_path)
    os.environ[ENV_VAR] = str(Path(config_path).resolve())
    return config


def _serve(args: argparse.Namespace) -> None:
    from storage.transport_grpc import serve

    config = _as_party(args.config)
    server, port = serve(config)
    host = config.listen.rsplit(":", 1)[0]
    print(f"party {config.party} serving its messages on {host}:{port}", flush=True)
    if args.flows:
        _serve_flows(config.party)
        server.stop(grace=2).wait()
        return
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()


def _serve_flows(party: str) -> None:
    """Serve this party's role-split flows from this process, on the party's own Prefect.

    Runs are started from that Prefect (UI, API or ``prefect deployment run``); they execute
    code this party installed, in a child of this process, as this party (its configuration
    is in the environment). No work pool job template is involved.
    """
    from prefect import serve

    from flows.align import psi_align_party
    from flows.vertical_party import vertical_lr_party

    serve(
        psi_align_party.to_deployment(name=party, tags=["privreg", party]),
        vertical_lr_party.to_deployment(name=party, tags=["privreg", party]),
    )


def _descriptor(text: str) -> dict[str, Any]:
    path = Path(text)
    return json.loads(path.read_text() if path.exists() else text)


def _psi(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    own = _descriptor(args.table)
    if own.get("party", Path(own["database"]).stem) != config.party:
        raise SystemExit(f"the table belongs to {own.get('party')!r}, not to {config.party!r}")
    from flows.align import psi_align_party

    result = psi_align_party(own, args.peer, args.job, min_rows=args.min_rows)
    print(json.dumps(result))


def _vertical(args: argparse.Namespace) -> None:
    config = _as_party(args.config)
    own = _descriptor(args.table) if args.table else None
    if own is not None and own.get("party", Path(own["database"]).stem) != config.party:
        raise SystemExit(f"the table belongs to {own.get('party')!r}, not to {config.party!r}")
    arbiter = None if args.no_arbiter else args.arbiter
    if args.role == "arbiter" and arbiter != config.party:
        raise SystemExit(f"this process is {config.party!r}, not the arbiter {arbiter!r}")
    from flows.vertical_party import vertical_lr_party

    result = vertical_lr_party(
        args.role,
        args.job,
        args.guest,
        [h for h in args.hosts.split(",") if h],
        own=own,
        arbiter=arbiter,
        **(_descriptor(args.options) if args.options else {}),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``certs`` and ``party`` to the ``privreg`` command."""
    certs = commands.add_parser("certs", help="a demo CA and per-party certificates")
    certs.add_argument("action", choices=["init", "issue"])
    certs.add_argument("--out", required=True, help="folder for the files")
    certs.add_argument("--ca", default=".", help="folder holding ca.pem and ca.key (issue)")
    certs.add_argument("--party", help="the party's name, as in its configuration (issue)")
    certs.add_argument("--name", default="privreg demo CA", help="the CA's name (init)")
    certs.set_defaults(handler=_certs)
    party = commands.add_parser("party", help="run as one party of a multi-organisation job")
    actions = party.add_subparsers(dest="party_command", required=True)
    serve = actions.add_parser("serve", help="serve this party's message endpoint")
    serve.add_argument("--config", required=True)
    serve.add_argument(
        "--flows", action="store_true", help="also serve the party's flows on its own Prefect"
    )
    serve.set_defaults(handler=_serve)
    psi = actions.add_parser("psi", help="this party's side of psi_align")
    psi.add_argument("--config", required=True)
    psi.add_argument("--table", required=True, help="own table descriptor (JSON or file)")
    psi.add_argument("--peer", required=True)
    psi.add_argument("--job", required=True, help="the job id both parties agreed on")
    psi.add_argument("--min-rows", type=int, default=100)
    psi.set_defaults(handler=_psi)
    vertical = actions.add_parser("vertical", help="this party's side of vertical_lr")
    vertical.add_argument("--config", required=True)
    vertical.add_argument("--job", required=True, help="the job id every party agreed on")
    vertical.add_argument("--role", required=True, choices=["guest", "host", "arbiter"])
    vertical.add_argument("--guest", required=True, help="the guest's party name")
    vertical.add_argument("--hosts", required=True, help="the hosts' names, comma-separated")
    vertical.add_argument("--table", help="own table descriptor (JSON or file; not the arbiter)")
    vertical.add_argument("--arbiter", default="arbiter", help="the arbiter's party name")
    vertical.add_argument("--no-arbiter", action="store_true", help="two-party mode")
    vertical.add_argument("--options", help="shared training options (JSON or file)")
    vertical.set_defaults(handler=_vertical)
